"""How a forward pass uses the cores: OpenBLAS runs one thread per call, and the row blocks of each
product (ops.row_blocks) are shared out among a few Python threads (numpy releases the GIL in BLAS).

Why not OpenBLAS's own threads (measured on a 2-core machine, BENCHMARKS.md "Threads"): they wait for
each other at every product, so when another process holds a core decode and prefill run several times
slower than with one thread; and OpenBLAS's matrix product rounds differently with one and two threads,
so a thread count that followed the machine would give the same prompt different bits (and a greedy
answer a different token) from one run to the next.

Here a product's blocks are fixed by its shape (more blocks than threads), each is one single-threaded
BLAS call, and each thread takes the next block when it finishes one: a thread on a busy core simply
takes fewer blocks, and the result is the same bits whatever the number of threads or the load.
Prefill (more than ops.SMALL_BATCH tokens) uses every core this process may run on; decode and verify
passes use THREADS_DECODE (see its comment).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

from .ops import ROW_BLOCKS, SMALL_BATCH, WORKERS

DECODE_THREADS = 1  # decode and verify passes (up to SMALL_BATCH tokens): see BENCHMARKS.md "Threads"


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

    def run(self, block, n: int) -> None:
        """block(i) for every i in range(n), each thread taking the next i when it is free."""
        todo = iter(range(n))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                block(i)

        helpers = [self.pool.submit(work) for _ in range(min(self.threads, n) - 1)]
        try:
            work()
        finally:
            with lock:  # on an error here, hand out nothing more; the helpers finish their block
                for _ in todo:
                    pass
            for f in helpers:
                f.result()


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
