"""How soon a stop acts, and how often a prefill tells its progress, on a real-size file (issue 47 point 2:
Ctrl-C within 0.5 s on any model; point 1: progress at least every second).

    python benchmarks/cancel.py ~/.cache/colichat-bench/v2lite-uniform.gguf [--tokens 105] [--expert-cache MIB]

Loads the file (the weights cache under the default cache dir is used if there), then prefills a prompt of
random token ids several times, each stopped (engine.cancel.Cancel.set from a timer thread, as a Ctrl-C
handler sets it) after a growing delay: it prints how long the stop took to act (the time from set() to
Cancelled raised), the largest gap between two progress calls, and, last, one whole prefill's time and gap.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from colichat.engine import load, prepare_kernels
from colichat.engine.cancel import Cancel, Cancelled
from colichat.paths import paths

DELAYS = (0.5, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0)  # seconds into the prefill when the stop comes


def stopped_prefill(model, ids: list[int], delay: float) -> tuple[float, float] | None:
    """(seconds from the stop to Cancelled, largest gap between progress calls), or None if it ended first."""
    cancel, ticks, set_at = Cancel(), [], []

    def stop() -> None:
        set_at.append(time.perf_counter())
        cancel.set()

    timer, start = threading.Timer(delay, stop), time.perf_counter()
    timer.start()
    try:
        with model.quiet():  # (as an answer reads its prompt: a warm start waits)
            model.prefill(ids, all_logits=False, cancel=cancel, progress=lambda done: ticks.append(time.perf_counter()))
    except Cancelled:
        end = time.perf_counter()
        return end - set_at[0], float(np.diff([start, *ticks, end]).max())
    timer.cancel()
    model.cache.truncate(0)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--tokens", type=int, default=105, help="prompt length (default 105, as issue 47 saw)")
    parser.add_argument("--expert-cache", type=float, default=None, help="MiB of routed experts kept")
    args = parser.parse_args()
    t0 = time.perf_counter()
    prepare_kernels(args.gguf, paths().cache)  # as a start does: compiled, or from numba's cache
    model = load(args.gguf, n_ctx=max(512, 2 * args.tokens), expert_cache=args.expert_cache,
                 cache_dir=paths().cache / "weights")
    print(f"loaded in {time.perf_counter() - t0:.1f} s")
    ids = np.random.default_rng(0).integers(100, min(5000, model.cfg.n_vocab), args.tokens).tolist()
    acted = []
    for delay in DELAYS:
        got = stopped_prefill(model, ids, delay)
        if got is None:
            print(f"stop at {delay:.1f} s: the prefill had ended")
            break
        acted.append(got[0])
        print(f"stop at {delay:.1f} s: acted in {got[0]:.3f} s; largest progress gap {got[1]:.2f} s")
    if acted:
        print(f"acted in at most {max(acted):.3f} s, median {float(np.median(acted)):.3f} s ({len(acted)} stops)")
    ticks, t1 = [], time.perf_counter()
    with model.quiet():
        model.prefill(ids, all_logits=False, progress=lambda done: ticks.append(time.perf_counter()))
    print(f"a whole {args.tokens}-token prefill: {time.perf_counter() - t1:.1f} s, {len(ticks)} progress calls, "
          f"largest gap {float(np.diff([t1, *ticks]).max()):.2f} s")


if __name__ == "__main__":
    main()
