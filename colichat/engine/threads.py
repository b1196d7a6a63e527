"""How many BLAS threads a forward pass uses (threadpoolctl sets OpenBLAS's count per pass).

Decode and verify passes (up to SMALL_BATCH tokens) are matrix-vector products, bound by memory
bandwidth: one thread streams the weights about as fast as two, and when another process holds a
core, OpenBLAS's second thread waits for it at every product (decode measured several times slower
with two threads than with one on a busy 2-core machine; BENCHMARKS.md). They use one thread.
Prefill is compute-bound and uses every core the process may run on.

The counts are fixed, not chosen from the machine's load: OpenBLAS's matrix product rounds
differently with one and with two threads, so a load-dependent choice would make the same prompt
give different bits (and a greedy answer a different token) from one run to the next.
"""

from __future__ import annotations

import os

from threadpoolctl import ThreadpoolController

from .ops import SMALL_BATCH


class ThreadPolicy:
    def __init__(self):
        self.controller = ThreadpoolController()
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        blas = [i["num_threads"] for i in self.controller.info() if i["user_api"] == "blas"]
        self.prefill_threads = min(blas) if blas else self.cores  # what the process started with

    def threads(self, tokens: int) -> int:
        return 1 if tokens <= SMALL_BATCH else self.prefill_threads

    def limit(self, tokens: int):
        """A context manager: BLAS threads for a pass over `tokens` tokens."""
        return self.controller.limit(limits=self.threads(tokens), user_api="blas")
