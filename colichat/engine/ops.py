"""Small array functions shared by the attention and FFN code (all float32, last axis)."""

from __future__ import annotations

import threading
from contextvars import ContextVar

import numpy as np

from .gguf.qmatrix import QMatrix

SMALL_BATCH = 16  # up to this many tokens, a pass computes every row exactly as a one-token pass would
MATVEC_BLOCK = 256 << 10  # bytes of a weight block kept in L2 while every row of a small batch reads it
ROW_BLOCKS = 8  # a product's outputs split into this many blocks (fewer for matrices under 128 rows)
ROW_ALIGN = 16  # block edges on multiples of this many outputs (whole BLAS kernel tiles)
MATVEC_SPLIT = 8 << 20  # bytes of weights from which a matrix-vector product is shared among threads
SHARED_BLOCK = 4 << 20  # bytes of a weight block every row of a small batch reads on OpenBLAS's threads (L2 + L3)
TILE_BYTES = 2 << 20  # f32 bytes of a quantized matrix's tile dequantized for a matrix product (prefill), at most
TILE_MIN_ROWS = 64  # rows of such a tile, at least (a product's tiles are about ROW_BLOCKS, for its threads)

# Who computes the row blocks of the current pass's products: a threads.Workers (set per pass by
# threads.ThreadPolicy.limit), or None for this thread alone. Either way the blocks are the same.
WORKERS: ContextVar = ContextVar("workers", default=None)
# How a pass of 1..SMALL_BATCH tokens computes its matrix-vector products: a threads.BlasMatvec
# (OpenBLAS's threads, set per pass by threads.ThreadPolicy.limit), or None for BLAS calls on this
# thread (or the WORKERS). The bits are the same.
MATVEC: ContextVar = ContextVar("matvec", default=None)
# The current pass's safe point (set per pass by Model.prefill: it checks the pass's stop request, and may
# raise, and tells its progress), called on the pass's thread between the blocks of a product, and by the
# routed experts (ffn.py) between theirs; None outside a pass.
SAFE_POINT: ContextVar = ContextVar("safe_point", default=None)
# Who computes the row blocks of a small pass's products with a QMatrix (the kernels release the GIL): a
# threads.Workers of the thread count the pass's timing picked (threads.ThreadPolicy.limit), or None.
KERNEL_WORKERS: ContextVar = ContextVar("kernel_workers", default=None)
# Each thread's f32 buffer for the tiles of quantized matrices it dequantizes (reused, never shared).
_TILES = threading.local()


def row_blocks(o: int) -> list[int]:
    """The fixed block edges of a product with `o` outputs: [0, ..., o], from the shape alone.

    A matrix product (more than SMALL_BATCH tokens) is computed as one single-threaded BLAS call per
    block, so its bits depend on these edges and on nothing else: not on how many threads share the
    blocks or which one computes which (OpenBLAS's own threads would round differently with their
    count, and the whole product rounds differently from its blocks)."""
    n = max(1, min(ROW_BLOCKS, o // ROW_ALIGN))
    return [o * i // n // ROW_ALIGN * ROW_ALIGN for i in range(n)] + [o]


def run_blocks(compute, store, n: int, workers) -> None:
    """store(i, compute(i)) for i in range(n): by `workers` (threads.Workers) if any, else here; the
    pass's SAFE_POINT before each block this thread computes."""
    point = SAFE_POINT.get() or (lambda: None)
    if workers is None or n == 1:
        for i in range(n):
            point()
            store(i, compute(i))
    else:
        workers.run(compute, store, n, point)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T: x (T, Z), w (O, Z) -> (T, O), computed by blocks of outputs (the pass's WORKERS).

    For T > SMALL_BATCH (a matrix product) the blocks are row_blocks(O), one single-threaded BLAS
    call each, whether one thread or several compute them: a prompt gives the same bits either way.

    For T <= SMALL_BATCH every output is a matrix-vector product, its weight row's dot product with
    one x row alone, so any split gives the same bits. On OpenBLAS's threads (MATVEC) each row is
    one such product per SHARED_BLOCK of weights. Else matrices under MATVEC_SPLIT bytes are one call
    (handing a block to another thread costs more than it saves), larger ones row_blocks(O) shared
    by the workers. For 2 <= T <= SMALL_BATCH, row i is bit for bit linear(x[i:i+1], w), so a verify
    pass of speculative decoding writes the same cache rows and logits as decoding its tokens one by
    one. The weights still stream from memory once: each block (MATVEC_BLOCK bytes on one thread)
    serves all T rows from the CPU cache. OpenBLAS's small-T matrix product is both slower here (it
    repacks the weights, 3-5x a matrix-vector product) and rounds differently.
    """
    if isinstance(w, QMatrix):
        return _qlinear(x, w)
    t = x.shape[0]
    workers = WORKERS.get()
    if t <= SMALL_BATCH:
        matvec = MATVEC.get()
        if matvec is not None:
            return matvec(x, w) if t == 1 else matvec.rows(x, w)
        if w.nbytes < MATVEC_SPLIT:
            workers = None
    if 1 < t <= SMALL_BATCH:
        return _matvec_rows(x, w, workers)
    if t == 1 and workers is None:
        return x @ w.T
    edges = row_blocks(w.shape[0])
    out = np.empty((t, w.shape[0]), dtype=np.result_type(x, w))  # (T, O)

    def store(i: int, y: np.ndarray) -> None:
        out[:, edges[i] : edges[i + 1]] = y

    run_blocks(lambda i: x @ w[edges[i] : edges[i + 1]].T, store, len(edges) - 1, workers)  # (T, block)
    return out


def _qlinear(x: np.ndarray, w: QMatrix) -> np.ndarray:
    """linear with a QMatrix w (O, Z): its blocks read in place, never the whole matrix as f32.

    The kernels' matrix-vector products where w takes T rows of x (w.takes: every type up to
    SMALL_BATCH, the int8 products at any T where they beat a tile): every output's bits independent
    of T, of the blocks and of the threads. x is rounded once (w.rounded), the parts split into
    ROW_BLOCKS blocks per part: in a small pass among its KERNEL_WORKERS when the matrix is large
    (MATVEC_SPLIT, counted as f32 bytes: the work), in a prefill among its WORKERS.
    Else (a prefill with another type): tiles of rows fixed by the shape (at most TILE_BYTES of f32 each,
    about O / ROW_BLOCKS rows and at least TILE_MIN_ROWS, so that a small matrix still has a tile for every
    thread: SmolLM2's 2048-token prefill ~5-10% faster than with 2 MiB tiles alone) are dequantized into
    the computing thread's buffer and multiplied with one single-threaded sgemm each,
    the tiles shared by the pass's WORKERS: the bits depend on the tile edges alone, as row_blocks'."""
    t, (o, z) = x.shape[0], w.shape
    x = np.ascontiguousarray(x, dtype=np.float32)  # (T, Z)
    out = np.empty((t, o), dtype=np.float32)  # (T, O)
    if w.takes(t):
        if t <= SMALL_BATCH:
            workers = KERNEL_WORKERS.get() if 4 * o * z >= MATVEC_SPLIT else None
        else:
            workers = WORKERS.get()
        edges = w.edges(None if workers is None else o // ROW_BLOCKS)
        xs = w.rounded(x)

        def compute(i: int) -> None:
            a, b = edges[i], edges[i + 1]
            w.matvec(xs, a, b, out[:, a:b])  # (T, b-a)
    else:
        workers = WORKERS.get()
        edges = w.edges(max(TILE_MIN_ROWS, min(TILE_BYTES // (4 * z), o // ROW_BLOCKS)))  # (enough to share)

        def compute(i: int) -> None:
            a, b = edges[i], edges[i + 1]
            buf = getattr(_TILES, "buf", None)
            if buf is None or buf.size < (b - a) * z:
                buf = _TILES.buf = np.empty(max(TILE_BYTES // 4, (b - a) * z), dtype=np.float32)
            out[:, a:b] = x @ w.dequantize(a, b, buf).T  # (T, b-a)

    # each block is written where it goes (a late block computed twice by Workers.run: the same bits)
    run_blocks(compute, lambda i, _: None, len(edges) - 1, workers)
    return out


def _matvec_rows(x: np.ndarray, w: np.ndarray, workers) -> np.ndarray:
    """linear for 2 <= T <= SMALL_BATCH: a matrix-vector product per row and weight block."""
    t = x.shape[0]
    o, z = w.shape
    blk = max(8, MATVEC_BLOCK // (4 * z) // 8 * 8)  # weight rows (outputs) per block
    nb = o // blk
    out = np.empty((t, o), dtype=np.result_type(x, w))  # (T, O)
    xc = np.ascontiguousarray(x)[None, :, :, None]  # (1, T, Z, 1): a column per row
    if nb:
        wb = w[: nb * blk].reshape(nb, 1, blk, z)  # (blocks, 1, blk, Z)
        groups = row_blocks(nb * ROW_ALIGN) if workers is not None else [0, nb * ROW_ALIGN]  # of weight blocks

        def group(i: int) -> np.ndarray:
            return np.matmul(wb[groups[i] // ROW_ALIGN : groups[i + 1] // ROW_ALIGN], xc)[..., 0]  # (b, T, blk)

        def store(i: int, y: np.ndarray) -> None:
            a, b = groups[i] // ROW_ALIGN * blk, groups[i + 1] // ROW_ALIGN * blk
            out[:, a:b] = y.transpose(1, 0, 2).reshape(t, b - a)

        run_blocks(group, store, len(groups) - 1, workers)
    for i in range(t) if nb * blk < o else ():
        out[i, nb * blk :] = w[nb * blk :] @ xc[0, i, :, 0]
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (the sum of squares in float64, as ggml)."""
    ss = np.einsum("...d,...d->...", x, x, dtype=np.float64)  # (...,) one pass, no temporaries
    scale = (1.0 / np.sqrt(ss / x.shape[-1] + eps)).astype(np.float32)
    out = x * scale[..., None]
    out *= weight
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """In place when possible: x is a scratch array of scores."""
    x -= np.max(x, axis=axis, keepdims=True)
    np.exp(x, out=x)
    x /= np.sum(x, axis=axis, keepdims=True)
    return x


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up in three passes over one new array (the SwiGLU hidden layer)."""
    h = np.exp(-gate)
    h += 1.0
    np.divide(gate, h, out=h)
    h *= up
    return h


def causal_mask(pos0: int, t: int, n: int) -> np.ndarray:
    """(T, N) additive mask: query i (position pos0+i) sees keys 0..pos0+i."""
    q = np.arange(pos0, pos0 + t)[:, None]
    k = np.arange(n)[None, :]
    return np.where(k <= q, np.float32(0.0), np.float32(-np.inf))
