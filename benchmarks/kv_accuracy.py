"""What --kv fp8 and --kv int4 cost: accuracy against f32, bytes a token, resume time.

    .venv/bin/python benchmarks/kv_accuracy.py [--turns 6]

Cases: every reference model of tests/data/tiny over its long reference tokens (320, the llama.cpp
reference runs), and a SmolLM2-135M-Instruct conversation of about 1,000 tokens: --turns exchanges
on benchmarks/loops.py's prompts, its answers written greedily by the f32 model, through the chat
template as colichat sends them. Each case is run teacher-forced (the same tokens for every codec) in
chunks of 64 tokens, the rows of each codec rounded as colichat rounds them when they enter the
cache; at every position the greedy token (argmax) of fp8 and int4 is compared with f32's:
  flips     the share of positions whose greedy token differs (colibri's gate for lossy KV: 0.05);
  max diff  the largest |logit - f32 logit| over all positions and the vocabulary, and the f32
            logits' own spread (max - min at a position, largest) to read it against;
  bytes     a record (a token) in the file;
  resume    reading the records back into the cache and decoding them, as /resume does (the file in
            the page cache), for the SmolLM2 conversation.
Prints a Markdown table (the one in BENCHMARKS.md) and writes benchmarks/out/kv_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from colichat.engine import Sampler, SamplerSettings, load  # noqa: E402
from colichat.engine.text.template import chat_template_for  # noqa: E402
from colichat.models.default import default_model_path  # noqa: E402
from colichat.persist.kvfile import CacheLayout, create_kv, read_records, write_nrec, write_records  # noqa: E402

TINY = HERE.parent / "tests" / "data" / "tiny"
CODECS = ("fp8", "int4")
CHUNK = 64
PROMPTS = ["Explain how a refrigerator works.", "Give me a recipe for pancakes.",
           "Tell me about the history of the bicycle.", "Write a poem about the sea.",
           "Explain the difference between weather and climate.", "Give me five tips for learning a new language.",
           "What are the planets of the solar system? Describe each in one sentence.",
           "Write a short email asking my manager for a day off."]


def logits_of(model, tokens: np.ndarray, codec: str) -> np.ndarray:
    """(T, V) logits of `tokens` from an empty cache keeping rows in `codec`, CHUNK tokens a pass."""
    model.reset()
    model.cache.set_codec(codec)
    return np.concatenate([model.prefill(tokens[i:i + CHUNK]) for i in range(0, tokens.size, CHUNK)])


def compare(model, tokens: np.ndarray) -> dict:
    base = logits_of(model, tokens, "f32")
    out = {"tokens": int(tokens.size), "spread": float((base.max(1) - base.min(1)).max()),
           "bytes": {"f32": model.cache.stored_bytes}}
    for codec in CODECS:
        if model.cache.codec_problem(codec):
            out[codec] = None
            continue
        got = logits_of(model, tokens, codec)
        out["bytes"][codec] = model.cache.stored_bytes
        out[codec] = {"flips": float(np.mean(got.argmax(1) != base.argmax(1))),
                      "max_diff": float(np.abs(got - base).max())}
    model.cache.set_codec("f32")
    return out


def conversation_tokens(model, turns: int, answer_tokens: int) -> np.ndarray:
    """About turns x (prompt + answer) tokens: the f32 model's greedy answers to PROMPTS."""
    template, tok = chat_template_for(model.tokenizer), model.tokenizer
    msgs, sampler = [], Sampler(SamplerSettings(temperature=0.0))
    for prompt in PROMPTS[:turns]:
        msgs.append({"role": "user", "content": prompt})
        ids = tok.encode_prompt(template.render(msgs, add_generation_prompt=True))
        model.reset()
        logits, answer = model.prefill(ids, all_logits=False)[-1], []
        for _ in range(answer_tokens):
            t = sampler(logits)
            if t in tok.eog_ids:
                break
            answer.append(t)
            logits = model.decode(t)
        msgs.append({"role": "assistant", "content": tok.decode(answer)})
    return np.array(tok.encode_prompt(template.render(msgs, add_generation_prompt=False)), dtype=np.int64)


def resume_ms(model, tokens: np.ndarray, codec: str, directory: str) -> float:
    """Milliseconds to read `tokens`' records of a `codec` file into the cache and decode them (best of 5)."""
    logits_of(model, tokens, codec)
    n, layout = model.cache.length, CacheLayout.from_cache(model.cache, model.cfg.n_vocab)
    path = os.path.join(directory, f"{codec}.coli_kv")
    fd = create_kv(path, layout)
    write_records(fd, 0, model.cache.raw(0, n), layout.record_bytes)
    write_nrec(fd, n)
    best = float("inf")
    for _ in range(5):
        model.reset()
        t0 = time.perf_counter()
        read_records(fd, model.cache.raw(0, n), layout.record_bytes)
        model.cache.loaded(n)
        model.cache.set_length(n)
        best = min(best, (time.perf_counter() - t0) * 1000)
    os.close(fd)
    model.cache.set_codec("f32")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer-tokens", type=int, default=150)
    args = ap.parse_args()
    rows = {}
    for ref in sorted(TINY.glob("*.long.ref.npz")):
        name = ref.name.removesuffix(".long.ref.npz")
        model = load(str(TINY / f"{name}.gguf"), n_ctx=512)
        rows[name] = compare(model, np.load(ref)["tokens_0"].astype(np.int64))
        print(name, rows[name], flush=True)
    model = load(default_model_path(), n_ctx=2048)
    tokens = conversation_tokens(model, args.turns, args.answer_tokens)
    row = compare(model, tokens)
    with tempfile.TemporaryDirectory() as d:
        row["resume_ms"] = {codec: resume_ms(model, tokens, codec, d) for codec in ("f32", *CODECS)}
    rows["SmolLM2-135M conversation"] = row
    print("SmolLM2", row, flush=True)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "kv_accuracy.json").write_text(json.dumps(rows, indent=1))
    print("\n| case | tokens | f32 logit spread | fp8 flips | fp8 max diff | int4 flips | int4 max diff "
          "| bytes a token f32 / fp8 / int4 | resume f32 / fp8 / int4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cells = []
        for codec in CODECS:
            c = r[codec]
            cells += ["(refused)", "-"] if c is None else [f"{c['flips']:.3f}", f"{c['max_diff']:.3f}"]
        sizes = " / ".join(f"{r['bytes'].get(c, '-'):,}" if c in r["bytes"] else "-" for c in ("f32", *CODECS))
        resume = " / ".join(f"{r['resume_ms'][c]:.1f} ms" for c in ("f32", *CODECS)) if "resume_ms" in r else "-"
        print(f"| {name} | {r['tokens']} | {r['spread']:.2f} | {' | '.join(cells)} | {sizes} | {resume} |")


if __name__ == "__main__":
    main()
