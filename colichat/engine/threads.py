"""How a forward pass uses the cores: OpenBLAS runs one thread per call (but for the matrix-vector
products of decode and verify passes, below), and the blocks of outputs of each product (ops.row_blocks)
are shared out among a few Python threads (numpy releases the GIL in BLAS).

Why not OpenBLAS's own threads (measured on a 2-core machine, BENCHMARKS.md "Threads"): they wait for
each other at every product, so when another process holds a core decode and prefill run several times
slower than with one thread; and OpenBLAS's matrix product rounds differently with one and two threads,
so a thread count that followed the machine would give the same prompt different bits (and a greedy
answer a different token) from one run to the next.

Here a matrix product's blocks are fixed by its shape (up to ops.ROW_BLOCKS, more than the threads),
each is one single-threaded BLAS call, and each thread takes the next block when it is done with one:
a thread on a busy core takes fewer blocks, and the caller computes a late helper's last block itself
rather than wait for a descheduled thread (Workers.run). The result has the same bits whatever the number
of threads or the load (tests/test_threads.py). GQA prefill attention shares its (KV head, block of queries)
tasks the same way, and on the kernel path a small pass's compiled attention its parts of the cache rows.

Per phase: prefill (passes of more than ops.SMALL_BATCH tokens, compute-bound) uses every core this
process may run on (at most ROW_BLOCKS). Small passes (decode's one token, a verify pass's 2..SMALL_BATCH:
matrix-vector products, bound by memory bandwidth, and attention over the cache) are where OpenBLAS's own
threads do pay on an idle machine (a matrix-vector product split among them gives the same bits,
tests/test_threads.py) and cost several times over when another process holds a core: so the OpenBLAS
thread count of their matrix-vector products follows their measured times (Faster), and on one thread
a verify pass's products use DECODE_THREADS.

Quantized weights (the kernel path: ops.linear on a gguf.qmatrix.QMatrix) use the same scheme with the
engine's own threads only: the compiled kernels release the GIL, so a small pass's products with them
run on the Workers of the count Faster picked (ops.KERNEL_WORKERS), each thread taking the next block of
rows, and prefill's dequantized tiles are shared by the prefill Workers as row blocks are. A small
pass's routed experts are shared out whole instead (ffn.moe), each expert's products on one thread.
numba's own thread pool (prange) is not used: one scheme, and the kernels' bits do not depend on the
split.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
from threadpoolctl import ThreadpoolController

from .ops import KERNEL_WORKERS, MATVEC, ROW_ALIGN, ROW_BLOCKS, SHARED_BLOCK, SMALL_BATCH, WORKERS

# verify passes (2..SMALL_BATCH tokens) on one OpenBLAS thread: a second Python thread sharing row blocks
# did not pay on a shared machine (BENCHMARKS.md "Threads"); products under ops.MATVEC_SPLIT bytes stay one
# call in any case
DECODE_THREADS = 1
PROBE_EVERY = 16  # small passes between tries of a thread count that is not the faster one ...
PROBE_MAX = 256  # ... doubling after each try it loses, up to this
ROW_COST = 0.3  # what each token after a pass's first adds to it, in one-token passes, until measured (RowCost)
ROW_COST_MAX = 2.0  # the most one timed pass can add to that measure (a descheduled pass would say more)
ROW_EXTRA = 0.5  # a pass of 2..SMALL_BATCH tokens costs as if it had this many tokens more (fitted: BENCHMARKS.md)
SLOWER = 1.5  # a pass of the current choice this much slower than its average has fewer threads tried at once


def cores() -> int:
    """The cores this process may run on (at most ROW_BLOCKS: more threads than blocks would idle)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(ROW_BLOCKS, n))


def pass_units(tokens: int, row_cost: float = ROW_COST) -> float:
    """A pass of 1..SMALL_BATCH tokens' expected time, in one-token passes (what Faster compares, and what
    speculative.gain weighs drafts by): 1 + row_cost (tokens - 1 + ROW_EXTRA) for more than one token."""
    return 1.0 if tokens == 1 else 1.0 + row_cost * (tokens - 1 + ROW_EXTRA)


class Workers:
    """The calling thread and `threads - 1` helper threads computing the blocks of one product."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="colichat-blas")

    def run(self, compute, store, n: int, point=lambda: None) -> None:
        """store(i, compute(i)) once for every i in range(n); returns when all are stored. point(): called
        on the calling thread before each block it takes (a safe point: if it raises, no block is stored).

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
            while True:
                point()
                if (i := next_block()) is None:
                    break
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


class Faster:
    """The faster of a few OpenBLAS thread counts for a recurring pass, chosen by timing the passes.

    The current choice runs every pass and its time is a running average; every other count is tried
    again after `wait` passes and taken over when one try beats that average. A count that loses waits
    twice as long before its next try (PROBE_EVERY .. PROBE_MAX passes), so on a machine where it keeps
    losing (another process holding a core: OpenBLAS's threads then wait for each other at every call,
    several times slower) the tries cost a few percent at most, and it is back within PROBE_MAX passes
    once the core is free again. A pass of the current choice SLOWER than its average (another process
    may have taken a core) has the smaller counts tried at the next pass, against that pass's time."""

    def __init__(self, counts: tuple[int, ...]):
        self.counts, self.best = counts, counts[0]
        self.seconds: float | None = None  # running average of the best count's passes
        self.passes = 0
        self.wait = dict.fromkeys(counts, PROBE_EVERY)
        self.due = dict.fromkeys(counts, 2)  # the pass at which a count is tried next (the first is timed)

    def pick(self) -> int:
        """The thread count for the next pass."""
        self.passes += 1
        return next((n for n in self.counts if n != self.best and self.passes >= self.due[n]), self.best)

    def record(self, n: int, seconds: float) -> None:
        """The pass run with n threads took `seconds`."""
        if n == self.best:
            if self.seconds is not None and seconds > SLOWER * self.seconds:  # another process took a core?
                for m in self.counts:
                    if m < n:
                        self.due[m] = self.passes + 1
                self.seconds = seconds  # the average before is stale: a try is measured against this pass
            else:
                self.seconds = seconds if self.seconds is None else 0.7 * self.seconds + 0.3 * seconds
        elif self.seconds is None or seconds < self.seconds:  # a try that wins: it becomes the choice
            self.due[self.best], self.wait[self.best] = self.passes + PROBE_EVERY, 2 * PROBE_EVERY
            self.best, self.seconds = n, seconds
        else:
            self.due[n] = self.passes + self.wait[n]
            self.wait[n] = min(2 * self.wait[n], PROBE_MAX)


class RowCost:
    """What each token after the first adds to a pass of up to SMALL_BATCH tokens, in one-token passes
    on the same thread count (pass_units' row_cost): a running average over timed passes, from ROW_COST.
    It grows with the context (each query's attention over the cache is its own), and with the machine's
    load."""

    def __init__(self):
        self.value = ROW_COST
        self.one: dict[int, float] = {}  # thread count -> running average seconds of its one-token passes

    def record(self, n: int, tokens: int, seconds: float) -> None:
        """A timed pass of `tokens` tokens on n threads took `seconds`."""
        one = self.one.get(n)
        if tokens == 1:
            self.one[n] = seconds if one is None else 0.7 * one + 0.3 * seconds
        elif one is not None:  # a descheduled pass counts at most ROW_COST_MAX
            row = min(ROW_COST_MAX, max(0.0, (seconds / one - 1) / (tokens - 1 + ROW_EXTRA)))  # pass_units
            self.value = 0.8 * self.value + 0.2 * row


class BlasMatvec:
    """x @ w.T for the rows x of a pass of 1..SMALL_BATCH tokens on `n` OpenBLAS threads, the pass's other
    BLAS calls staying on one.

    OpenBLAS splits a matrix-vector product by outputs, each still its row's dot product, but its kernel
    computes outputs in groups, and an output left over at the end of a thread's share would round as a
    lone one: so each call here has a multiple of ROW_ALIGN * n outputs (equal shares of whole groups),
    and the last few outputs are one call on one thread. The bits are then one thread's
    (tests/test_threads.py). Its matrix products (attention's query rows against the cache) round
    differently with the thread count, so they stay on one thread: hence per call, not per pass (setting
    the count costs about a microsecond)."""

    def __init__(self, libs, n: int):
        self.libs, self.n = libs, n

    def _set(self, n: int) -> None:
        for lib in self.libs:
            lib.set_num_threads(n)

    def _product(self, x, w, out) -> None:
        """out (O,) = w (O, Z) @ x (Z,), with n threads set; leaves n threads set."""
        a = w.shape[0] // (ROW_ALIGN * self.n) * (ROW_ALIGN * self.n)
        np.matmul(w[:a], x, out=out[:a])
        if a < w.shape[0]:
            self._set(1)
            np.matmul(w[a:], x, out=out[a:])
            self._set(self.n)

    def __call__(self, x, w):
        """x (1, Z) @ w.T: one product over the whole matrix."""
        return self._rows(x, w, w.shape[0])

    def rows(self, x, w):
        """x (T, Z) @ w.T, row i bit for bit self(x[i:i+1], w): per block of ops.SHARED_BLOCK bytes of
        weights, a matrix-vector product per row, the later rows reading the block from the CPU cache
        (one thread's L2 is too small for a block worth sharing among threads; L3 holds it)."""
        step = ROW_ALIGN * self.n
        return self._rows(x, w, max(step, SHARED_BLOCK // (4 * w.shape[1]) // step * step))  # whole shares

    def _rows(self, x, w, blk: int):
        """x (T, Z) @ w.T by blocks of `blk` weight rows (a multiple of ROW_ALIGN * n, or all of them)."""
        t, o = x.shape[0], w.shape[0]
        out = np.empty((t, o), dtype=np.result_type(x, w))  # (T, O)
        self._set(self.n)
        try:
            for a in range(0, o, blk):
                for i in range(t):
                    self._product(x[i], w[a : a + blk], out[i, a : a + blk])
        finally:
            self._set(1)
        return out


class ThreadPolicy:
    """Per pass: the OpenBLAS threads, and the workers for the pass's products (None: this thread); a
    small pass's products with quantized weights run on Workers of the OpenBLAS thread count it picks.

    decode: Python threads sharing the row blocks of verify passes' large products (ops.MATVEC_SPLIT)
    when small passes run on one OpenBLAS thread.
    prefill: Python threads sharing prefill's row blocks (default: the cores).
    one_token: the OpenBLAS thread counts small passes (up to SMALL_BATCH tokens: decode, verify) choose
    from by their times (Faster); one count fixes it (default: 1 and the cores).
    row_cost: what a verify pass's drafts cost (speculative.gain); None: as measured (RowCost)."""

    def __init__(self, decode: int = DECODE_THREADS, prefill: int | None = None,
                 one_token: tuple[int, ...] | None = None, row_cost: float | None = None):
        self.controller = ThreadpoolController()
        self.decode, self.prefill = decode, cores() if prefill is None else prefill
        self.blas = self.controller.select(user_api="blas").lib_controllers
        if not self.blas:  # a BLAS threadpoolctl does not know: its own threads stay as they are
            one_token = (1,)
        self.one_token = Faster(one_token or tuple(sorted({1, cores()})))
        self._workers: dict[int, Workers] = {}
        self._matvec = {n: BlasMatvec(self.blas, n) for n in self.one_token.counts if n > 1}
        self.rows, self.fixed_row_cost = RowCost(), row_cost

    def row_cost(self) -> float:
        """What each drafted token adds to a verify pass, in decode steps (speculative.gain): as measured
        (RowCost), or as fixed by the constructor."""
        return self.rows.value if self.fixed_row_cost is None else self.fixed_row_cost

    def threads(self, tokens: int) -> int:
        return self.decode if tokens <= SMALL_BATCH else self.prefill

    def workers(self, tokens: int) -> Workers | None:
        n = self.threads(tokens)
        return self._pool(n) if n > 1 else None

    def _pool(self, n: int) -> Workers:
        if n not in self._workers:  # threads start on first use
            self._workers[n] = Workers(n)
        return self._workers[n]

    @contextmanager
    def limit(self, tokens: int, timed: bool = True):
        """A context manager for a pass over `tokens` tokens. A pass of up to SMALL_BATCH tokens (decode,
        a verify pass) runs its matrix-vector products on the OpenBLAS threads Faster picks and, if
        `timed` (the trunk's passes), tells it how long the pass took per unit of work (pass_units);
        an untimed one (an MTP draft step) takes the current choice."""
        if tokens > SMALL_BATCH:
            with self.controller.limit(limits=1, user_api="blas"):
                token = WORKERS.set(self.workers(tokens))
                try:
                    yield
                finally:
                    WORKERS.reset(token)
            return
        n = self.one_token.pick() if timed else self.one_token.best
        with self.controller.limit(limits=1, user_api="blas"):
            token = WORKERS.set(self.workers(tokens) if n == 1 and tokens > 1 else None)
            matvec = MATVEC.set(self._matvec.get(n))
            kernel = KERNEL_WORKERS.set(self._pool(n) if n > 1 else None)  # (quantized products: our threads)
            t0 = time.perf_counter()
            try:
                yield
            finally:
                KERNEL_WORKERS.reset(kernel)
                MATVEC.reset(matvec)
                WORKERS.reset(token)
            if timed:
                seconds = time.perf_counter() - t0
                self.one_token.record(n, seconds / pass_units(tokens))
                self.rows.record(n, tokens, seconds)
