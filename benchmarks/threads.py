"""The thread policy measured: prefill, decode and a verify pass with one thread, with two threads
sharing each product's fixed row blocks (engine/threads.py), and with OpenBLAS's own two threads on
whole products (the policy before the row blocks), on the machine as it is and with one more process
spinning on a core (started and stopped here).

    python benchmarks/threads.py                  # SmolLM2 and the V2-Lite-shaped MLA model
    python benchmarks/threads.py --skip-deepseek  # SmolLM2 only
    make bench ARGS="--threads-only"              # the same, through bench.py

The variants take turns, several rounds; each figure is the median of its rounds. Other load on the
machine moves every figure: read them as ratios within one run (the "vs 1" columns).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import say  # noqa: E402

VERIFY_TOKENS = 5  # the verify pass measured: 4 drafts and the token before them


class OpenBLASThreads:
    """The policy before the row blocks: each product one BLAS call on OpenBLAS's own `n` threads."""

    def __init__(self, n: int):
        from threadpoolctl import ThreadpoolController

        self.controller, self.n = ThreadpoolController(), n

    @contextmanager
    def limit(self, tokens: int):
        from colichat.engine import ops

        blocks = ops.row_blocks
        ops.row_blocks = lambda o: [0, o]  # one block: the whole product in one call
        try:
            with self.controller.limit(limits=self.n, user_api="blas"):
                yield
        finally:
            ops.row_blocks = blocks


def variants() -> list[tuple[str, object]]:
    """(label, thread policy): one thread; two sharing prefill's row blocks with the matrix-vector products
    of decode and verify passes on OpenBLAS's two threads; OpenBLAS's two on whole products (the policy
    before the row blocks). The engine's default, which picks decode's threads by timing them, is measured too
    (bench_threads: one policy for the whole run, as a running program has)."""
    from colichat.engine.threads import ThreadPolicy

    return [("1", ThreadPolicy(decode=1, prefill=1, one_token=(1,))),
            ("2, row blocks", ThreadPolicy(decode=2, prefill=2, one_token=(2,))),
            ("2, OpenBLAS", OpenBLASThreads(2))]


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def bench_threads(model, decode_tokens: int = 16, prefill_tokens: int = 256, rounds: int = 3) -> list[dict]:
    """Prefill of `prefill_tokens` in one pass, decode after 64 cached tokens and a verify pass of
    VERIFY_TOKENS tokens, with each variant, on the machine as is and with one core kept busy."""
    rng = np.random.default_rng(9)
    ids = rng.integers(0, model.cfg.n_vocab, prefill_tokens)
    toks = rng.integers(0, model.cfg.n_vocab, decode_tokens)
    from colichat.engine.threads import ThreadPolicy

    saved, rows, engine = model.threads, [], ThreadPolicy()
    for busy in (False, True):
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(stop,), daemon=True) if busy else None
        if spinner:
            spinner.start()
        try:
            times: dict[str, list] = {}
            for _ in range(rounds):
                for label, policy in variants() + [("engine (decode timed)", engine)]:
                    model.threads = policy
                    model.reset()
                    t0 = time.perf_counter()
                    model.prefill(ids, all_logits=False)
                    prefill = time.perf_counter() - t0
                    model.cache.truncate(64)
                    t0 = time.perf_counter()
                    for t in toks:
                        model.decode(int(t))
                    decode = (time.perf_counter() - t0) / decode_tokens
                    model.cache.truncate(64)
                    t0 = time.perf_counter()
                    model.prefill(toks[:VERIFY_TOKENS])
                    verify = time.perf_counter() - t0
                    times.setdefault(label, []).append((prefill, decode, verify))
            for label, ts in times.items():
                prefill, decode, verify = (float(np.median(c)) for c in zip(*ts, strict=True))
                rows.append({"busy": busy, "threads": label, "prefill_tps": prefill_tokens / prefill,
                             "decode_tps": 1 / decode, "verify_tps": VERIFY_TOKENS / verify})
                say(f"  {'busy' if busy else 'as is'}, threads {label}: prefill {prefill_tokens / prefill:.0f} "
                    f"tok/s, decode {1 / decode:.2f} tok/s, verify pass {VERIFY_TOKENS / verify:.1f} tok/s")
        finally:
            model.threads = saved
            if spinner:
                stop.set()
                spinner.join()
    return rows


def table(rows: list[dict]) -> list[str]:
    """The markdown table of bench_threads' rows, with each figure's ratio to one thread."""
    lines = [f"| machine | threads | prefill tok/s | vs 1 | decode tok/s | vs 1 | verify pass of {VERIFY_TOKENS} tok/s "
             "| vs 1 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    base = {}
    for r in rows:
        base.setdefault(r["busy"], r)
        b = base[r["busy"]]
        lines.append(f"| {'one core busy' if r['busy'] else 'as is'} | {r['threads']} | "
                     f"{r['prefill_tps']:.0f} | {r['prefill_tps'] / b['prefill_tps']:.2f} | "
                     f"{r['decode_tps']:.2f} | {r['decode_tps'] / b['decode_tps']:.2f} | "
                     f"{r['verify_tps']:.1f} | {r['verify_tps'] / b['verify_tps']:.2f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-deepseek", action="store_true", help="only SmolLM2")
    p.add_argument("--ff", type=int, default=2816, help="dense FFN width of the deepseek2 model (default 2816)")
    p.add_argument("--rounds", type=int, default=5, help="turns of every variant (default 5)")
    args = p.parse_args(argv)
    from common import OUT, deepseek_gguf

    from colichat.engine import load
    from colichat.engine.threads import ThreadPolicy
    from colichat.models.default import default_model_path

    OUT.mkdir(parents=True, exist_ok=True)
    models = [("SmolLM2-135M", Path(default_model_path()), 16, 256)]
    if not args.skip_deepseek:
        models.append((f"V2-Lite-shaped (FFN {args.ff})", deepseek_gguf(args.ff), 8, 64))
    res, lines = {}, []
    for label, path, decode_tokens, prefill_tokens in models:
        say(f"threads: {label}")
        model = load(str(path), n_ctx=2048)
        res[label] = bench_threads(model, decode_tokens, prefill_tokens, args.rounds)
        lines += [f"### {label} (prefill of {prefill_tokens} tokens, decode after 64)", ""] + table(res[label]) + [""]
        del model
    policy = ThreadPolicy()
    counts = " or ".join(map(str, policy.one_token.counts))
    lines.append(f"The engine's default (engine/threads.py): prefill {policy.prefill} threads on row blocks; the "
                 f"matrix-vector products of decode and verify passes on {counts} OpenBLAS threads, whichever "
                 "their timed passes find faster.")
    (OUT / "threads.json").write_text(json.dumps(res, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
