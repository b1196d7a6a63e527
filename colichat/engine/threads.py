"""How a forward pass uses the cores: OpenBLAS runs one thread per call, and the blocks of outputs of
each product (ops.row_blocks) are shared out among a few Python threads (numpy releases the GIL in BLAS).

Why not OpenBLAS's own threads (measured on a 2-core machine, BENCHMARKS.md "Threads"): they wait for
each other at every product, so when another process holds a core decode and prefill run several times
slower than with one thread; and OpenBLAS's matrix product rounds differently with one and two threads,
so a thread count that followed the machine would give the same prompt different bits (and a greedy
answer a different token) from one run to the next.

Here a matrix product's blocks are fixed by its shape (up to ops.ROW_BLOCKS, more than the threads),
each is one single-threaded BLAS call, and each thread takes the next block when it is done with one:
a thread on a busy core takes fewer blocks, and the caller computes a late helper's last block itself
rather than wait for a descheduled thread (Workers.run). The result has the same bits whatever the number
of threads or the load (tests/test_threads.py). GQA prefill attention shares its KV heads the same way.

Per phase: prefill (passes of more than ops.SMALL_BATCH tokens, compute-bound) uses every core this
process may run on (at most ROW_BLOCKS). Decode and verify passes (matrix-vector products, bound by
memory bandwidth) use DECODE_THREADS. Their bits never depend on a split; whether a second thread pays
there is a matter of speed alone (benchmarks/threads.py).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

from .ops import ROW_BLOCKS, SMALL_BATCH, WORKERS

# decode and verify passes (up to SMALL_BATCH tokens): a second thread did not pay on a shared machine
# (BENCHMARKS.md "Threads"); products under ops.MATVEC_SPLIT bytes stay one call in any case
DECODE_THREADS = 1


def cores() -> int:
    """The cores this process may run on (at most ROW_BLOCKS: more threads than blocks would idle)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(ROW_BLOCKS, n))


class Workers:
    """The calling thread and `threads - 1` helper threads computing the blocks of one product."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="colichat-blas")

    def run(self, compute, store, n: int) -> None:
        """store(i, compute(i)) once for every i in range(n); returns when all are stored.

        Each thread takes the next block when it is free. When none is left, the calling thread waits
        for the helpers' blocks about as long as one block took it, then computes a late one itself
        (the same call: the same bits) and whichever copy is ready first is stored: a helper that a
        busy core has descheduled holds the product up by about one block, not for its whole wait."""
        lock, finished = threading.Lock(), threading.Event()
        handed, done, left = [0], [False] * n, [n]

        def next_block() -> int | None:
            with lock:
                if handed[0] == n:
                    return None
                handed[0] += 1
                return handed[0] - 1

        def keep(i: int, result) -> None:
            with lock:
                if done[i]:
                    return  # the other copy was first
                done[i] = True
                store(i, result)
                left[0] -= 1
                if not left[0]:
                    finished.set()

        def work() -> None:
            while (i := next_block()) is not None:
                keep(i, compute(i))

        for _ in range(min(self.threads, n) - 1):
            self.pool.submit(work)
        block_s = None  # how long a block took here
        try:
            while (i := next_block()) is not None:
                t0 = time.perf_counter()
                keep(i, compute(i))
                block_s = time.perf_counter() - t0
            while not finished.wait(block_s):
                with lock:
                    late = next((j for j in range(n) if not done[j]), None)
                if late is not None:
                    keep(late, compute(late))
        except BaseException:
            with lock:  # nothing more is handed out or stored
                handed[0] = n
                done[:] = [True] * n
            raise


class ThreadPolicy:
    """Per pass: one OpenBLAS thread, and the workers for the pass's products (None: this thread)."""

    def __init__(self, decode: int = DECODE_THREADS, prefill: int | None = None):
        self.controller = ThreadpoolController()
        self.decode, self.prefill = decode, cores() if prefill is None else prefill
        self._workers: dict[int, Workers] = {}

    def threads(self, tokens: int) -> int:
        return self.decode if tokens <= SMALL_BATCH else self.prefill

    def workers(self, tokens: int) -> Workers | None:
        n = self.threads(tokens)
        if n <= 1:
            return None
        if n not in self._workers:  # threads start on first use
            self._workers[n] = Workers(n)
        return self._workers[n]

    @contextmanager
    def limit(self, tokens: int):
        """A context manager for a pass over `tokens` tokens."""
        with self.controller.limit(limits=1, user_api="blas"):
            token = WORKERS.set(self.workers(tokens))
            try:
                yield
            finally:
                WORKERS.reset(token)
