"""Prefix reuse: one ~1,500-token document asked five questions, each a new conversation (as five `-p`
runs of a script are), with reuse and with --no-reuse.

    .venv/bin/python benchmarks/reuse.py [--model PATH] [--no-reuse-runs 5]

The document is FORMAT.md's opening (real prose), cut to about 1,500 tokens of the model's tokenizer.
Each run is a new Conversation over one loaded model, saved into a fresh store (the first run with
reuse is saved like `--session doc -p`); an answer is one token (time to the first token is the
point). Reported per run: the prompt tokens, those prefilled and those reused, and the time to the
first token (the prompt's read or prefill, then the first decode step). Writes
benchmarks/out/reuse-MODEL.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from colichat.conversation.chat import Conversation, Settings  # noqa: E402
from colichat.engine import load  # noqa: E402
from colichat.models.default import default_model_path  # noqa: E402
from colichat.persist import Store  # noqa: E402

QUESTIONS = ["What is the magic of the KV file?", "Summarize the document in two sentences.",
             "What happens after a crash?", "Which fields does the header hold?", "How is a fork saved?"]


def document(model, tokens: int) -> str:
    text = (HERE.parent / "FORMAT.md").read_text("utf-8")
    ids = model.tokenizer.encode(text)[:tokens]
    return model.tokenizer.decode(ids)


def run(model, store: Store, text: str, reuse: bool, name: str | None) -> dict:
    model.reset()
    model.cache.set_codec("f32")
    conv = Conversation(model, Settings(temperature=0, max_tokens=1, draft=0), store=store, session_name=name,
                        reuse=reuse, save_new=name is not None)
    first: list[float] = []
    t0 = time.perf_counter()
    _, stats = conv.ask(text, on_text=lambda s: first or first.append(time.perf_counter()))
    conv.close()
    ttft = (first[0] if first else time.perf_counter()) - t0
    return {"prompt": stats.prompt_tokens + stats.reused, "prefilled": stats.prompt_tokens,
            "reused": stats.reused, "ttft_s": round(ttft, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--no-reuse-runs", type=int, default=5, help="questions asked with --no-reuse too")
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args()
    path = args.model or default_model_path()
    model = load(path, n_ctx=args.ctx)
    doc = document(model, args.tokens)
    out = {"model": Path(path).name, "reuse": [], "no_reuse": []}
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "sessions")
        for i, q in enumerate(QUESTIONS):
            r = run(model, store, f"{doc}\n\n{q}", True, "doc" if i == 0 else None)
            out["reuse"].append(r)
            print("reuse   ", q, r, flush=True)
        for q in QUESTIONS[: args.no_reuse_runs]:
            r = run(model, Store(Path(d) / "none"), f"{doc}\n\n{q}", False, None)
            out["no_reuse"].append(r)
            print("no-reuse", q, r, flush=True)
    (HERE / "out").mkdir(exist_ok=True)
    (HERE / "out" / f"reuse-{Path(path).stem}.json").write_text(json.dumps(out, indent=1))
    print("\n| run | prompt tokens | reuse: prefilled / reused, first token | --no-reuse: prefilled, first token |")
    print("|---|---|---|---|")
    for i, r in enumerate(out["reuse"]):
        n = out["no_reuse"][i] if i < len(out["no_reuse"]) else None
        other = f"{n['prefilled']:,}, {n['ttft_s']:.2f} s" if n else "(not run)"
        print(f"| {i + 1} | {r['prompt']:,} | {r['prefilled']:,} / {r['reused']:,}, {r['ttft_s']:.2f} s | {other} |")


if __name__ == "__main__":
    main()
