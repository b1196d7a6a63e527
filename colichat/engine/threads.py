"""How many BLAS threads a forward pass uses (threadpoolctl sets OpenBLAS's count per pass).

Decode and verify passes (up to SMALL_BATCH tokens) are matrix-vector products, bound by memory
bandwidth: one thread streams the weights about as fast as two, and when another process holds a
core, OpenBLAS's second thread waits for it at every product (decode measured 7-8x slower with two
threads than with one on a busy 2-core machine; BENCHMARKS.md). Prefill is compute-bound and uses
every core, unless other processes kept a core busy since the last pass: then one thread, which
costs at most the busy core's share.
"""

from __future__ import annotations

import os
import time

from threadpoolctl import ThreadpoolController

from .ops import SMALL_BATCH

BUSY_SHARE = 0.5  # cores' worth of other processes' CPU time from which a core counts as taken
MIN_WINDOW = 0.2  # seconds: a shorter interval since the last look reuses the last decision


def _cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds of every process on the machine, of this process), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    t = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), t.user + t.system


class ThreadPolicy:
    def __init__(self):
        self.controller = ThreadpoolController()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._last = (time.monotonic(), _cpu_seconds())
        self._busy = 0

    def others_busy(self) -> int:
        """Cores other processes kept busy since the last look (whole cores, rounded down from the share)."""
        now, cpu = time.monotonic(), _cpu_seconds()
        t0, cpu0 = self._last
        if cpu is None or cpu0 is None:
            return 0
        if now - t0 >= MIN_WINDOW:
            others = ((cpu[0] - cpu0[0]) - (cpu[1] - cpu0[1])) / (now - t0)
            self._busy = int(others + 1 - BUSY_SHARE) if others >= BUSY_SHARE else 0
            self._last = (now, cpu)
        return self._busy

    def threads(self, tokens: int) -> int:
        if tokens <= SMALL_BATCH or self.cores == 1:
            return 1
        return max(1, self.cores - self.others_busy())

    def limit(self, tokens: int):
        """A context manager: BLAS threads for a pass over `tokens` tokens."""
        return self.controller.limit(limits=self.threads(tokens), user_api="blas")
