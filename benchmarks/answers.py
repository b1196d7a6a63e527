"""Does the default model answer simple questions sanely? Temperatures compared on twelve questions.

    .venv/bin/python benchmarks/answers.py [--seeds 3] [--max-tokens 96]

For every question and candidate temperature, the default model (SmolLM2-135M-Instruct) answers a
fresh conversation with the chat template, as colichat does, with the other settings at colichat's
defaults (top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1 over the last 256 tokens). An answer
is right when it holds the question's expected word (case-insensitive), and a loop as in
benchmarks/loops.py. Prints a Markdown table (the one in models.md) and writes
benchmarks/out/answers.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from loops import LOOP_SHARE, answer, repetition  # noqa: E402

from colichat.conversation.settings import TABLE  # noqa: E402
from colichat.engine import Sampler, SamplerSettings, load  # noqa: E402
from colichat.engine.text.template import chat_template_for  # noqa: E402
from colichat.models.default import default_model_path  # noqa: E402

QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("How many days are there in a week?", "seven|7"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the largest planet in the solar system?", "jupiter"),
    ("Who wrote Romeo and Juliet?", "shakespeare"),
    ("What is 2 + 2?", "4|four"),
    ("What gas do plants take in from the air?", "carbon dioxide|co2"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What is the opposite of hot?", "cold"),
    ("In which continent is Egypt?", "africa"),
]
TEMPERATURES = [0.7, 0.5, 0.3, 0.2, 0.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    defaults = {row.name: row.default for row in TABLE if row.name in SamplerSettings.__dataclass_fields__}
    model = load(default_model_path(), n_ctx=2048)
    template = chat_template_for(model.tokenizer)
    rows = {}
    for temp in TEMPERATURES:
        results = []
        for seed in range(args.seeds if temp > 0 else 1):  # (greedy: one seed says it all)
            for question, expected in QUESTIONS:
                settings = SamplerSettings(**{**defaults, "temperature": temp, "seed": seed})
                kind, ids = answer(model, template, Sampler(settings), question, args.max_tokens,
                                   settings.repeat_last_n)
                text = model.tokenizer.decode(ids)
                right = any(word in text.lower() for word in expected.split("|"))
                results.append({"question": question, "seed": seed, "right": right, "outcome": kind,
                                "repetition": round(repetition(ids), 3), "text": text})
                print(f"t={temp} seed {seed} {'right' if right else 'WRONG':5s} {kind:6s} {question[:40]}: "
                      f"{text[:70]!r}", flush=True)
        rows[temp] = results
    print(f"\n| temperature | right | loops (>= {LOOP_SHARE:.0%} repeated 5-grams) | answers |\n|---|---|---|---|")
    for temp, results in rows.items():
        right = sum(r["right"] for r in results)
        loops = sum(r["outcome"] == "loop" for r in results)
        print(f"| {temp} | {right} ({right / len(results):.0%}) | {loops} | {len(results)} |")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "answers.json").write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=1))


if __name__ == "__main__":
    main()
