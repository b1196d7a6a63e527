"""Does the default model loop on everyday requests? Sampler settings compared on ten prompts.

    .venv/bin/python benchmarks/loops.py [--max-tokens 384] [--seeds 1]

For every prompt and every candidate setting, the default model (SmolLM2-135M-Instruct) answers a
fresh conversation with the chat template, as colichat does. An answer is classed:
  ended  the model ended its turn;
  length it reached --max-tokens without repeating itself;
  loop   it did not end, and at least 15% of its last 100 tokens start a 5-token sequence that it
         had already written in this answer (it circles over the same phrases). Lists and recipes
         that ended are never counted as loops, whatever they repeat.
Prints a Markdown table (the one in models.md) and writes benchmarks/out/loops.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from colichat.engine import Sampler, SamplerSettings, load  # noqa: E402
from colichat.engine.text.template import chat_template_for  # noqa: E402
from colichat.models.default import default_model_path  # noqa: E402

PROMPTS = [
    "Write a short story about a cat who learns to fly.",
    "List ten fruits and one fact about each.",
    "Explain how a refrigerator works.",
    "Give me a recipe for pancakes.",
    "What are the planets of the solar system? Describe each in one sentence.",
    "Write a poem about the sea.",
    "Explain the difference between weather and climate.",
    "Give me five tips for learning a new language.",
    "Tell me about the history of the bicycle.",
    "Write a short email asking my manager for a day off.",
]

CANDIDATES = {
    "repeat_penalty 1.0 (off)": dict(repeat_penalty=1.0, repeat_last_n=64),
    "repeat_penalty 1.1, last 64": dict(repeat_penalty=1.1, repeat_last_n=64),
    "repeat_penalty 1.1, last 256": dict(repeat_penalty=1.1, repeat_last_n=256),
}


def repetition(ids: list[int], n: int = 5, tail: int = 100) -> float:
    """Share of the last `tail` positions that start an n-gram already seen earlier in `ids`."""
    first: dict[tuple, int] = {}
    for i in range(len(ids) - n + 1):
        first.setdefault(tuple(ids[i : i + n]), i)
    starts = range(max(0, len(ids) - tail), len(ids) - n + 1)
    return sum(first[tuple(ids[i : i + n])] < i for i in starts) / max(len(starts), 1)


LOOP_SHARE = 0.15


def answer(model, template, sampler: Sampler, prompt: str, max_tokens: int, window: int) -> tuple[str, list[int]]:
    tok = model.tokenizer
    model.reset()
    ids = tok.encode_prompt(template.render([{"role": "user", "content": prompt}], True))
    logits = model.prefill(ids, all_logits=False)[-1]
    out: list[int] = []
    for _ in range(max_tokens):
        cache = model.cache
        tid = sampler(logits, cache.tokens[max(0, cache.length - window) : cache.length])
        if tid in tok.eog_ids:
            return "ended", out
        out.append(tid)
        logits = model.decode(tid)
    return ("loop" if repetition(out) >= LOOP_SHARE else "length"), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="*", help="indices of the candidate settings to run (default: all)")
    args = ap.parse_args()
    model = load(default_model_path(), n_ctx=2048)
    template = chat_template_for(model.tokenizer)
    rows = {}
    chosen = [c for i, c in enumerate(CANDIDATES.items()) if args.only is None or i in args.only]
    for label, extra in chosen:
        results = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for prompt in PROMPTS:
                sampler = Sampler(SamplerSettings(seed=seed, **extra))
                kind, ids = answer(model, template, sampler, prompt, args.max_tokens, extra["repeat_last_n"])
                results.append({"prompt": prompt, "seed": seed, "outcome": kind, "tokens": len(ids),
                                "repetition": round(repetition(ids), 3),
                                "text": model.tokenizer.decode(ids)})
                print(f"{label:32s} seed {seed} {kind:6s} {len(ids):4d}  {prompt[:50]}", flush=True)
        rows[label] = results
    print("\n| setting | ended | max tokens, no loop | loop | mean tokens |\n|---|---|---|---|---|")
    for label, results in rows.items():
        count = {k: sum(r["outcome"] == k for r in results) for k in ("ended", "length", "loop")}
        mean = sum(r["tokens"] for r in results) / len(results)
        print(f"| {label} | {count['ended']} | {count['length']} | {count['loop']} | {mean:.0f} |")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "loops.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
