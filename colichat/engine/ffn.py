"""Feed-forward blocks: SwiGLU, and the deepseek2 mixture of experts (routing, routed experts kept
quantized and dequantized per expert into a slab of fixed slots (ExpertCache), shared experts).

Axis letters: engine/__init__.py (T, D, F; X routed experts, U used per token, Y expert groups).
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import ModelError
from .gguf import dequant
from .gguf.qmatrix import QMatrix
from .ops import KERNEL_WORKERS, SAFE_POINT, SMALL_BATCH, WORKERS, linear, run_blocks, silu_mul

NORM_MIN = 6.1035e-5  # llama.cpp clamps the sum of the selected weights here before normalizing
FILL_THREADS = 2  # threads dequantizing an expert cache's misses at once (at most the cores there are)
PREFETCH_TOKENS = 4  # passes of at most this many tokens (decode, a verify pass) prefetch the next layer's experts


def swiglu(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """W_down (silu(W_gate x) * W_up x). x: (T, D); w_gate_up: (2F, D) = [gate; up]; w_down: (D, F)."""
    f = w_down.shape[1]
    gu = linear(x, w_gate_up)  # (T, 2F)
    h = silu_mul(gu[:, :f], gu[:, f:])  # (T, F)
    return linear(h, w_down)  # (T, D)


@dataclass(frozen=True)
class Routing:
    """How a deepseek2 router picks experts (from the GGUF keys; mla-spec section 5.5)."""

    n_used: int             # U
    gating: int = 1         # 1 softmax, 2 sigmoid
    norm: bool = False      # expert_weights_norm
    scale: float = 0.0      # expert_weights_scale: applied only if not 0 or 1 (newer llama.cpp)
    n_group: int = 0        # expert_group_count: group-limited selection only if > 1
    n_group_used: int = 0


def route(
    x: np.ndarray, w_router: np.ndarray, bias: np.ndarray | None, r: Routing
) -> tuple[np.ndarray, np.ndarray]:
    """Pick U experts per token: ids (T, U) and their weights (T, U), all in float32."""
    logits = linear(x.astype(np.float32, copy=False), w_router)  # (T, X)
    if r.gating == 2:
        probs = 1.0 / (1.0 + np.exp(-logits))  # (T, X)
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    return select_experts(probs, bias, r)


def select_experts(probs: np.ndarray, bias: np.ndarray | None, r: Routing) -> tuple[np.ndarray, np.ndarray]:
    """From the router probabilities (T, X): the U experts (T, U), best first, and their weights.

    The selection bias (exp_probs_b) only chooses; weights come from the unbiased probabilities.
    As llama.cpp: the weights' sum is taken in double (ggml_sum_rows), then clamped and divided.
    """
    sel = (probs + bias).astype(np.float32) if bias is not None else probs.copy()  # (T, X)
    t, x = sel.shape
    if r.n_group > 1:
        grouped = sel.reshape(t, r.n_group, x // r.n_group)  # (T, Y, X/Y)
        top2 = np.sort(grouped, axis=2)[:, :, -2:]
        score = (top2[:, :, 0] + top2[:, :, 1]).astype(np.float32)  # (T, Y) top-2 sum per group
        drop = np.argsort(-score, axis=1, kind="stable")[:, r.n_group_used :]  # (T, Y - used)
        np.put_along_axis(grouped, drop[:, :, None], -np.inf, axis=1)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, : r.n_used]  # (T, U)
    w = np.take_along_axis(probs, ids, axis=1).astype(np.float32)  # (T, U)
    if r.norm:
        total = np.cumsum(w.astype(np.float64), axis=1)[:, -1:].astype(np.float32)  # (T, 1)
        w = (w / np.maximum(total, np.float32(NORM_MIN))).astype(np.float32)
    if r.scale not in (0.0, 1.0):
        w = (w * np.float32(r.scale)).astype(np.float32)
    return ids, w


class Part(NamedTuple):
    """Where one expert's share of a *_exps tensor lies in the GGUF, and where it goes in a slot."""

    qtype: object  # gguf.GGMLQuantizationType
    path: str      # the file (a part of a split model)
    offset: int    # of expert 0's bytes in the file
    n_bytes: int   # of one expert
    row_bytes: int
    start: int     # floats [start, stop) of a slot's 3FD: gate (or gate_up), up, down
    stop: int


class ExpertCache:
    """Routed experts of every MoE layer, dequantized on use into a slab of fixed slots.

    `get(layer, e)` returns one expert's f32 (gate_up (2F, D), down (D, F)): views of its slot, valid
    until the next get (moe() uses them at once). Every routed expert of a model has the same shape.

    Slab: one f32 array (S, 3FD) of S = capacity // slot bytes slots (at most one per routed expert),
    made with np.empty: a slot's pages are touched when first filled, then only overwritten, so a miss
    allocates nothing but the dequantizer's temporaries. A capacity below one expert caches nothing:
    every use dequantizes into a single scratch slot.

    Policy: use frequency with aging. Every expert (resident or not) has a count, +1 per use; every
    `aging` uses, as many as the model has routed experts (X L), all counts are halved, so a count is
    about its expert's uses over the last two such periods. A miss fills a free slot, else evicts the
    resident expert with the lowest count (the least recently used among equal counts): a burst of
    one-off experts evicts one-off experts, not the ones most tokens are routed to.

    Reading: a miss reads the expert's quantized bytes with os.preadv into a reusable buffer (one per
    filling thread), not through the GGUF memory map, so they do not stay resident in this process (the
    kernel's page cache holds them, outside RSS; through the map every expert ever read would stay
    counted in RSS).

    Filling: `fetch(layer, es)` makes a group of experts resident at once (at most `batch`, the slots
    there are), and dequantizes its misses on `fill_threads` threads (the calling one and a helper on
    the second core: numpy releases the GIL in its kernels). A fill writes the same bits on any thread.
    Called from one thread at a time.

    Prefetch (`prefetch=True`; off by default, see __init__): `prefetch(layer, es)`, the experts a router
    predicts for the next layer, takes their slots now (as misses would) and fills them on a worker thread
    while this layer computes; a fetch that finds one waits for its fill (a wrong prediction only costs its
    slot and the worker's time: no fetch waits on a fill it does not use). Which experts are resident never
    changes what a pass computes, so output is the same with prefetch on or off (`prefetcher` None).

    Warm start: `warm(counts)` takes the use counts an earlier run kept (`usage()`, saved beside the
    weights cache: gguf/prepared.py): the policy starts from them, and a background thread fills free slots
    with the most used experts, one at a time, while the prompt is usable. It never evicts, and a fetch
    that needs the expert it is filling waits for that one fill (at most a miss's time). `lock` guards the
    slots' bookkeeping between it and fetch/prefetch (held through a fetch: the warmer pauses meanwhile).
    While colichat answers (`paused()`, Model.quiet) the warmer waits before its next fill.

    Safe points: the pass's ops.SAFE_POINT is called before each miss's fill on the calling thread (it may
    raise: a stop; the fills under way end first, and their slots stay free), and before each expert's
    product (moe).
    """

    def __init__(self, tensors, layers: list[int], capacity_bytes: int, prefetch: bool = False):
        self.tensors = tensors
        self.layers = set(layers)
        self.capacity = max(0, int(capacity_bytes))
        self.hits = self.misses = 0
        self.order = {l: i for i, l in enumerate(layers)}  # expert index k = order[layer] * X + e
        self.by_index = list(layers)
        x, d, f = tensors.shape(f"blk.{layers[0]}.ffn_down_exps.weight")  # (X, D, F)
        self.n_expert, self.shape = x, (f, d)
        self.parts = {l: self._parts(l) for l in layers}
        per = 3 * f * d  # floats of one expert: gate_up (2F, D) then down (D, F)
        stride = -(-per // 16) * 16  # slots start on 64-byte boundaries
        self.slot_bytes = 4 * stride
        n = min(self.capacity // self.slot_bytes, x * len(layers))  # S
        self.caching = n > 0
        self.fill_threads = min(FILL_THREADS, _cores())
        try:  # (without caching: a scratch slot per filling thread)
            self.slab = _aligned_empty(n if n else self.fill_threads, stride)  # (S, 3FD + pad)
        except MemoryError:
            raise ModelError(f"an expert cache of {n:,} experts ({n * self.slot_bytes >> 20:,} MiB) does not fit "
                             "in memory: ask for a smaller one") from None
        self.flat = [row[:per] for row in self.slab]  # S x (3FD,)
        self.views = [(v[: 2 * f * d].reshape(2 * f, d), v[2 * f * d :].reshape(d, f)) for v in self.flat]
        self.keys = np.full(len(self.flat), -1, dtype=np.int64)  # (S,) expert index held, -1 free
        self.last = np.zeros(len(self.flat), dtype=np.int64)  # (S,) tick of the last use
        self.slot_of: dict[int, int] = {}  # expert index -> slot
        self.counts = np.zeros(x * len(layers), dtype=np.float64)  # (L X,) aged use counts
        self.aging = x * len(layers)
        self.tick = 0
        self.batch = len(self.flat)  # experts a fetch can hold at once
        self.read_bytes = max(p.n_bytes for ps in self.parts.values() for p in ps)
        self.bufs = threading.local()  # .buf: each filling thread's read buffer
        self.pool = ThreadPoolExecutor(self.fill_threads - 1, "colichat-experts") if self.fill_threads > 1 else None
        # prefetch (asked for, with a cache and a second core): a worker filling predicted experts' slots. Off
        # by default: on 2 cores decode has no idle core to hide it in, and it measured no faster (BENCHMARKS.md)
        on = prefetch and self.caching and _cores() > 1
        self.prefetcher = ThreadPoolExecutor(1, "colichat-prefetch") if on else None
        self.pending: dict[int, Future] = {}  # slot -> its prefetch fill, until a fetch or a sweep settles it
        self.held: set[int] = set()  # the slots the last fetch returned (in use until the next)
        self.predicted: dict[int, set[int]] = {}  # layer -> the experts prefetched for its next fetch
        # experts fetched after a prediction, those of them predicted, and experts filled ahead
        self.predictions = self.predicted_right = self.prefetched = 0
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # set when the cache is dropped: the warmer stops after its fill
        self.warmer: threading.Thread | None = None
        self.warming = self.warmed = 0  # experts the warm start takes on, and has filled
        self.unpaused = threading.Event()  # cleared while colichat answers: the warmer waits (paused())
        self.unpaused.set()
        self.fds: dict[str, int] = {}
        weakref.finalize(self, _close_all, self.fds, self.pool, self.prefetcher, self.stopping, self.unpaused)

    def _parts(self, l: int) -> list[Part]:
        t, b, x = self.tensors, f"blk.{l}.", self.n_expert
        f, d = self.shape
        if t.has(b + "ffn_gate_up_exps.weight"):
            names, shapes = ["ffn_gate_up_exps"], [(x, 2 * f, d)]
        else:
            names, shapes = ["ffn_gate_exps", "ffn_up_exps"], [(x, f, d)] * 2
        names, shapes = names + ["ffn_down_exps"], shapes + [(x, d, f)]
        parts, at = [], 0
        for name, shape in zip(names, shapes, strict=True):
            name = b + name + ".weight"
            assert t.shape(name) == shape, f"{name}: {t.shape(name)}, not {shape}: all experts share one shape"
            n = t.nbytes(name) // x
            parts.append(Part(t.qtype(name), t.files[name], t.offsets[name], n, n // shape[1], at,
                              at + shape[1] * shape[2]))
            at = parts[-1].stop
        return parts

    @property
    def bytes(self) -> int:
        """Bytes of the experts held (a slot each)."""
        return len(self.slot_of) * self.slot_bytes

    @property
    def entries(self) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """(layer, e) -> (gate_up, down) of every expert held."""
        x = self.n_expert
        return {(self.by_index[k // x], k % x): self.views[s] for k, s in self.slot_of.items()}

    def get(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        return self.fetch(layer, [e])[0]

    def fetch(self, layer: int, es: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(gate_up (2F, D), down (D, F)) of experts `es` (distinct, at most `batch`) of `layer`, all
        resident until the next fetch; misses are dequantized on up to fill_threads threads."""
        if len(es) > self.batch:
            raise ValueError(f"{len(es)} experts at once, more than the {self.batch} slots")
        with self.lock:
            return self._fetch(layer, es)

    def _fetch(self, layer: int, es: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        self._sweep()
        ks = [self.order[layer] * self.n_expert + e for e in es]
        guess = self.predicted.pop(layer, None)
        if guess is not None:
            self.predictions += len(es)
            self.predicted_right += len(guess.intersection(es))
        for k in ks:  # a prefetched expert's fill ends first (one that failed is a miss)
            if self.slot_of.get(k) in self.pending:
                self._settle(self.slot_of[k])
        slots = [self.slot_of.get(k) for k in ks]
        held = {s for s in slots if s is not None}  # (this group's: never a victim of its own misses)
        jobs = []
        for i, (k, s) in enumerate(zip(ks, slots, strict=True)):
            self.tick += 1
            if s is None:
                self.misses += 1
                s = slots[i] = self.victim(held)
                held.add(s)
                if self.caching:  # emptied first: a fill cut short (Ctrl-C, a read error) leaves a free slot
                    self.slot_of.pop(int(self.keys[s]), None)
                    self.keys[s] = -1
                jobs.append((s, layer, es[i]))
            else:
                self.hits += 1
            self.counts[k] += 1
            self.last[s] = self.tick
            if self.tick % self.aging == 0:
                self.counts *= 0.5
        self._fill_all(jobs)
        if self.caching:
            for k, s in zip(ks, slots, strict=True):
                self.keys[s], self.slot_of[k] = k, s
        self.held = set(slots)
        return [self.views[s] for s in slots]

    def prefetch(self, layer: int, es: list[int]) -> None:
        """Experts `es` of `layer` are likely its next fetch's: the ones not resident take a slot (not one
        the last fetch returned, nor one being filled) and are filled on the worker thread."""
        if self.prefetcher is None:
            return
        with self.lock:
            self._prefetch(layer, es)

    def _prefetch(self, layer: int, es: list[int]) -> None:
        self._sweep()
        self.predicted[layer] = set(es)
        for e in es:
            k = self.order[layer] * self.n_expert + e
            if k in self.slot_of or len(self.held) + len(self.pending) >= len(self.keys):
                continue
            s = self.victim(self.held)
            self.slot_of.pop(int(self.keys[s]), None)
            self.keys[s], self.slot_of[k], self.last[s] = k, s, self.tick
            self.pending[s] = self.prefetcher.submit(self._fill, self.flat[s], layer, e)
            self.prefetched += 1

    def usage(self) -> np.ndarray:
        """The aged use counts of every routed expert (L X,): what warm() takes on a later start."""
        with self.lock:
            return self.counts.astype(np.float32)

    def warm(self, counts: np.ndarray) -> None:
        """Start from an earlier run's usage() (ignored unless it has this model's shape): the policy
        knows the counts, and a background thread fills the free slots with the most used experts."""
        if not self.caching or self.warmer is not None or np.shape(counts) != self.counts.shape:
            return
        counts = np.nan_to_num(np.asarray(counts, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
        with self.lock:
            self.counts[:] = np.maximum(counts, 0.0)
            top = np.argsort(-self.counts, kind="stable")[: len(self.keys)]
            order = [int(k) for k in top if self.counts[k] > 0]
            self.warming = len(order)
        self.warmer = threading.Thread(target=self._warm, args=(order,), name="colichat-warm", daemon=True)
        self.warmer.start()

    @contextmanager
    def paused(self):
        """The warm start waits meanwhile (after the fill under way, if any)."""
        self.unpaused.clear()
        try:
            yield
        finally:
            self.unpaused.set()

    def _warm(self, order: list[int]) -> None:
        """Fill free slots with experts `order` (most used first), one at a time, until none is free;
        each waits while the cache is paused()."""
        x = self.n_expert
        for k in order:
            self.unpaused.wait()
            with self.lock:
                if self.stopping.is_set():
                    return
                if k in self.slot_of:
                    continue
                taken = self.held | set(self.pending)
                free = [s for s in np.flatnonzero(self.keys < 0).tolist() if s not in taken]
                if not free:
                    return
                s = free[0]
                self.keys[s], self.slot_of[k], self.last[s] = k, s, self.tick
                done = self.pending[s] = Future()
            try:
                self._fill(self.flat[s], self.by_index[k // x], k % x)
            except OSError as e:  # (a read error: the slot is freed when a fetch or a sweep settles it)
                done.set_exception(e)
                return
            except BaseException as e:  # a bug: a fetch waiting for this fill must not wait forever
                done.set_exception(e)
                raise
            done.set_result(None)
            self.warmed += 1

    def _sweep(self) -> None:
        """Settle the fills ahead (prefetch, warm start) that have ended: their slots can be evicted again."""
        for s in [s for s, f in self.pending.items() if f.done()]:
            self._settle(s)

    def _settle(self, s: int) -> None:
        """Wait for slot s's prefetch fill; if it failed, the slot is free again (its expert a miss)."""
        future = self.pending.pop(s)
        wait([future])
        if future.exception() is not None:
            self.slot_of.pop(int(self.keys[s]), None)
            self.keys[s] = -1

    def victim(self, held=frozenset()) -> int:
        """The slot a miss fills, not one of `held`: a free one, else the lowest count's (least recently
        used of equals); without caching, a scratch slot."""
        held = set(held) | set(self.pending)  # (a slot being filled is taken)
        free = [s for s in np.flatnonzero(self.keys < 0).tolist() if s not in held]
        if free or not self.caching:
            return free[0]
        c = np.where(np.isin(np.arange(len(self.keys)), list(held)), np.inf, self.counts[self.keys])  # (S,)
        low = np.flatnonzero(c == c.min())
        return int(low[np.argmin(self.last[low])])

    def _fill_all(self, jobs: list[tuple[int, int, int]]) -> None:
        """Fill slots (slot, layer, e): the calling thread and the helper take the next job when free; it
        returns once every fill has ended (an error or Ctrl-C too: no fill goes on into a slot after it)."""
        between = SAFE_POINT.get() or (lambda: None)
        if self.pool is None or len(jobs) < 2:
            for s, layer, e in jobs:
                between()
                self._fill(self.flat[s], layer, e)
            return
        lock, todo = threading.Lock(), iter(jobs)

        def work(point=lambda: None) -> None:
            while True:
                point()
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                s, layer, e = job
                self._fill(self.flat[s], layer, e)

        helper = self.pool.submit(work)
        try:
            work(between)
        except BaseException:
            with lock:  # nothing more is handed out; the helper's fill under way ends before this returns
                for _ in todo:
                    pass
            wait([helper])
            raise
        helper.result()

    def _fill(self, flat: np.ndarray, layer: int, e: int) -> None:
        """Dequantize expert e of `layer` into a slot's floats (3FD,), part by part."""
        for p in self.parts[layer]:
            raw = self._read(p.path, p.offset + e * p.n_bytes, p.n_bytes)  # (n_bytes,) uint8
            _dequantize(raw, p.qtype, p.row_bytes, flat[p.start : p.stop])

    def _read(self, path: str, offset: int, n: int) -> np.ndarray:
        """n bytes of `path` from `offset`, into this thread's reusable buffer (no memory map, no new array)."""
        fd = self.fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY)
            if self.fds.setdefault(path, fd) != fd:  # (another filling thread opened it first)
                os.close(fd)
                fd = self.fds[path]
        buf = getattr(self.bufs, "buf", None)
        if buf is None:
            buf = self.bufs.buf = np.empty(self.read_bytes, dtype=np.uint8)
        view, done = memoryview(buf)[:n], 0
        while done < n:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{path}: ends before byte {offset + n:,} (an expert's data)")
            done += got
        return buf[:n]


def _dequantize(raw: np.ndarray, qtype, row_bytes: int, out: np.ndarray) -> None:
    """One expert's raw bytes (uint8) -> `out` (flat f32, written in place): the values
    Tensors.f32(name, expert=e) gives."""
    import gguf

    fast = dequant.FAST.get(qtype.name)
    if fast is not None:
        fast(raw, out=out)
    else:
        np.copyto(out, gguf.quants.dequantize(raw.reshape(-1, row_bytes), qtype).reshape(-1))


def _aligned_empty(rows: int, cols: int) -> np.ndarray:
    """np.empty((rows, cols), float32) starting on a 64-byte boundary (pages untouched until written)."""
    base = np.empty(rows * cols + 16, dtype=np.float32)
    skip = (-base.ctypes.data % 64) // 4
    return base[skip : skip + rows * cols].reshape(rows, cols)


def _close_all(fds: dict, pool, prefetcher, stopping: threading.Event, unpaused: threading.Event) -> None:
    stopping.set()
    unpaused.set()  # (a paused warmer wakes to see it stop)
    for each in (pool, prefetcher):  # (a prefetch fill under way ends before its file is closed)
        if each is not None:
            each.shutdown(wait=True)
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _expert_outputs(x, order, k: int, group: list, resident: list, workers) -> list:
    """swiglu of each expert of `group` on its tokens (x[order[a:b] // k]): [(M, D)]. Experts multiplied in
    the map (QMatrix, the kernel path) are shared out whole among the pass's workers (KERNEL_WORKERS in a
    small pass, WORKERS in a prefill), each expert's products on one thread: a decode pass's experts are
    small matrices (DeepSeek-V2-Lite's: 2048 x 1408) that cost less than handing their row blocks to
    another thread, and a prefill's are many. The products' bits do not depend on the thread, so neither
    do the outputs. Else one after another, each product split as linear splits it; the pass's safe point
    before each expert (a long prefill's layer is many of them)."""
    def one(i: int) -> np.ndarray:
        (_, a, b), (gate_up, down) = group[i], resident[i]
        return swiglu(x[order[a:b] // k], gate_up, down)  # (M, D)

    ys = [None] * len(group)
    if workers is not None and len(group) > 1 and isinstance(resident[0][0], QMatrix):
        def whole(i: int) -> np.ndarray:
            tokens = KERNEL_WORKERS.set(None), WORKERS.set(None)  # (its products on this thread alone)
            try:
                return one(i)
            finally:
                KERNEL_WORKERS.reset(tokens[0])
                WORKERS.reset(tokens[1])

        run_blocks(whole, ys.__setitem__, len(group), workers)
        return ys
    between = SAFE_POINT.get() or (lambda: None)
    for i in range(len(group)):
        between()
        ys[i] = one(i)
    return ys


def moe(x: np.ndarray, ids: np.ndarray, w: np.ndarray, layer: int, experts: ExpertCache,
        ahead: tuple[int, list[int]] | None = None) -> np.ndarray:
    """sum_u w[t, u] * expert_{ids[t, u]}(x[t]); tokens grouped by expert (a loop over experts hit only).
    `ahead`: (next layer, its predicted experts), prefetched once this layer's first group is resident.
    The pass's safe point (ops.SAFE_POINT) is called before each expert's product: a long prefill's layer
    of resident experts is many of them.

    x: (T, D); ids, w: (T, U). Returns (T, D).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # (T*U,)
    order = np.argsort(flat, kind="stable")  # (T*U,) assignments sorted by expert
    hit, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], flat.size)
    out = np.zeros_like(x)  # (T, D)
    wf = w.reshape(-1)
    spans = list(zip(hit.tolist(), starts.tolist(), ends.tolist(), strict=True))
    workers = KERNEL_WORKERS.get() if t <= SMALL_BATCH else WORKERS.get()
    for g in range(0, len(spans), experts.batch):  # a group of experts resident at once (ExpertCache.fetch)
        group = spans[g : g + experts.batch]
        resident = experts.fetch(layer, [e for e, _, _ in group])
        if ahead is not None and g == 0:
            experts.prefetch(*ahead)
        ys = _expert_outputs(x, order, k, group, resident, workers)
        for (_, a, b), y in zip(group, ys, strict=True):  # added in the experts' order: the same bits
            sel = order[a:b]  # (M,) assignment indices of expert e
            y *= wf[sel][:, None]
            out[sel // k] += y  # (each token picks an expert at most once)
    return out
