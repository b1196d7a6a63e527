"""The expert cache's warm start at the real size (issue 34, point 5): what a start that remembers which
experts an earlier run used gains, on the files of benchmarks/moe.py.

    .venv/bin/python benchmarks/moe_warm.py [--uniform-only | --skewed-only] [--layers 3]

Per file, three colichat processes, each loading with a weights cache (--dir/weights-cache: the first start
writes it, later ones map it, as the chat does):
  earlier  a conversation of other tokens (prefill 512, decode 24), then its experts' use counts are kept
           beside the weights cache (what every answer of the chat does);
  warm     a new start: load, the background warm-up of the most used experts to its end (timed: a user
           typing the first message gives it that time), then the first message (prefill 64) and decode 24;
  cold     the same start and tokens with the warm start turned off (the counts not read).
Each phase records the share of the CPUs other processes used. Markdown on stdout, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from common import GIB, cpu_mark, others_share, peak_rss, run_child, say
from moe import FIRST, N_CTX, SEED, SKEW_BIAS, model_file, spec_for, token_ids


def child(mode: str, path: str, cache_dir: str, expert_cache: float | None) -> dict:
    """One start of colichat (mode earlier, warm or cold) on one file: its figures."""
    from colichat.engine import ffn, load

    if mode == "cold":  # (no counts read: the policy and the slots start empty)
        ffn.ExpertCache.warm = lambda self, counts: None
    n_vocab = spec_for(27, False).n_vocab
    tokens = token_ids(n_vocab)
    prompt, decode = tokens["prompt64"], tokens["decode"][:FIRST]
    if mode == "earlier":
        rng = np.random.default_rng(SEED + 1)  # another conversation than the one measured
        prompt, decode = rng.integers(300, n_vocab, 512).tolist(), rng.integers(300, n_vocab, FIRST).tolist()
    out, t = {}, time.perf_counter()
    m = load(path, n_ctx=N_CTX, expert_cache=expert_cache, cache_dir=cache_dir)
    e = m.experts
    out["load_s"] = time.perf_counter() - t
    if e.warmer is not None:
        e.warmer.join()
    out["warm_s"], out["warmed"], out["slots"] = time.perf_counter() - t - out["load_s"], e.warmed, len(e.slab)

    def phase(name: str, run) -> None:
        h, mi = e.hits, e.misses
        a = cpu_mark()
        run()
        b = cpu_mark()
        out[name] = {"s": b[0] - a[0], "others_cpu": others_share(a, b), "hits": e.hits - h, "misses": e.misses - mi}

    phase("prefill", lambda: m.prefill(prompt, all_logits=False))
    phase("decode", lambda: [m.decode(i) for i in decode])
    out["n_prompt"], out["peak_rss"] = len(prompt), peak_rss()
    if mode == "earlier":
        m.keep_expert_usage()
        out["kept"] = m.usage_entry is not None and (m.usage_entry / "usage.npy").is_file()
    return out


def report(label: str, runs: dict) -> None:
    print(f"### {label} routing\n\n| start | load, s | warm-up, s (experts filled / slots) | prefill 64, tok/s | "
          "its hit rate | decode 1-24, tok/s | its hit rate | peak RSS, GiB | others' CPU share |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for mode in ("warm", "cold"):
        r = runs[mode]
        if "error" in r:
            print(f"| {mode} | failed: {r['error'][:300]} |")
            continue
        p, d = r["prefill"], r["decode"]
        rate = lambda q: q["hits"] / max(1, q["hits"] + q["misses"])  # noqa: E731
        print(f"| {mode} | {r['load_s']:.1f} | {r['warm_s']:.1f} ({r['warmed']} / {r['slots']}) | "
              f"{r['n_prompt'] / p['s']:.2f} | {rate(p):.0%} | {FIRST / d['s']:.2f} | {rate(d):.0%} | "
              f"{r['peak_rss'] / GIB:.1f} | {p['others_cpu']:.2f} / {d['others_cpu']:.2f} |")
    print()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = p.add_mutually_exclusive_group()
    only.add_argument("--skewed-only", action="store_true")
    only.add_argument("--uniform-only", action="store_true")
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "colichat-bench")
    p.add_argument("--expert-cache", type=float, help="colichat's expert cache in MiB (default: the engine's)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "GGUF", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.expert_cache)))
        return 0
    cache = ["--expert-cache", str(args.expert_cache)] if args.expert_cache else []
    summary = {}
    print(f"## Expert-cache warm start, {args.layers} layers, {time.strftime('%Y-%m-%d %H:%M')}\n")
    for label in ("uniform", "skewed"):
        if args.skewed_only and label == "uniform" or args.uniform_only and label == "skewed":
            continue
        path = model_file(args.dir, args.layers, label == "skewed", SKEW_BIAS)
        runs = {}
        for mode in ("earlier", "warm", "cold"):
            say(f"{label}: {mode}")
            runs[mode] = run_child([sys.executable, __file__, "--child", mode, str(path),
                                    str(args.dir / "weights-cache"), *cache])
        report(label, runs)
        summary[label] = runs
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
