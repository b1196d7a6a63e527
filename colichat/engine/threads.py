"""How many BLAS threads a forward pass uses (threadpoolctl sets OpenBLAS's count per pass).

Measured on a 2-core machine (BENCHMARKS.md, "Threads"): decode and verify passes (matrix-vector
products, bound by memory bandwidth) gain little from a second thread on a quiet machine and lose
several times their speed with it when another process holds a core, because OpenBLAS's threads
wait for each other at every product; prefill loses as much. The thread count must also not follow
the machine's load: OpenBLAS's matrix product rounds differently with one and with two threads, so
a load-dependent choice would give the same prompt different bits (and a greedy answer a different
token) from one run to the next. So both phases use one thread, and a busy machine costs at most
the busy core's share.
"""

from __future__ import annotations

from threadpoolctl import ThreadpoolController

from .ops import SMALL_BATCH

DECODE_THREADS = 1   # decode and verify passes (up to SMALL_BATCH tokens)
PREFILL_THREADS = 1  # longer passes


class ThreadPolicy:
    def __init__(self, decode: int = DECODE_THREADS, prefill: int = PREFILL_THREADS):
        self.controller = ThreadpoolController()
        self.decode, self.prefill = decode, prefill

    def threads(self, tokens: int) -> int:
        return self.decode if tokens <= SMALL_BATCH else self.prefill

    def limit(self, tokens: int):
        """A context manager: BLAS threads for a pass over `tokens` tokens."""
        return self.controller.limit(limits=self.threads(tokens), user_api="blas")
