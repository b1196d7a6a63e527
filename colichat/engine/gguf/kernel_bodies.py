"""The compiled bodies of kernels.py: plain Python over numpy arrays, compiled by numba (kernels.prepare()).
This module: the shared helpers, F32, F16, BF16 and the 32-value blocks; kernel_kquants.py: the 256-value ones.

Imported only once numba is known to be there, and only by kernels.py. Per type, as ggml keeps them side
by side: `_row_<type>(wr, xt, xs)` the dot product of one row's blocks with one row of x, and
`_block_<type>(wr, o, y, yo)` the values of the block at byte o into y[yo:]; `matvec_<type>` and
`dequant_<type>` (undecorated here: kernels.prepare() compiles them, nogil, cached on disk) run them over
the rows. The helpers are njit functions compiled into the kernels that call them (numba's cache keeps
the kernels, each with its helpers inside).

Shapes: w (R, row_bytes) uint8, whole blocks; x (T, Z) float32; xs (T, Z / width) float32 the sums of x
over each sub-block of `width` values (sub_sums); out (T, R) or (R, Z) float32.

The order of the sums, fixed by the code: the 32-value types (Q8_0 and the rest of this module) keep 32
float32 lanes, lane i the sum of value i of every block (its scale applied to each product), added in
order at the end: no fastmath, and LLVM vectorizes the lanes (a per-block sum it unrolls and vectorizes
across blocks, with gathers, 3x slower). The K-quants and floats sum a sub-block's codes times x in
float32 with fastmath "reassoc" (LLVM's vectorized reduction: its lanes are fixed by the compiled code,
the same for every row, T and thread), apply its scale once to that sum and its minimum through xs, and
add blocks into float64. Each out[t, r] is a function of w[r], x[t] (and xs[t], a function of x[t])
alone. The dequantizers take no fastmath: their float32 operations are gguf-py's, in its order (d * sc
first, then times q, then the minimum), so their bits are its bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
F64 = np.float64
FAST = {"reassoc", "nsz", "arcp", "contract"}  # the matvec bodies' fastmath: vectorized sums, no change to NaN or inf
fast = njit(fastmath=FAST)
_POW2 = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf])  # fp16: (1024 + m) 2^(e - 25)
_SIGN = np.array([1.0, -1.0])
_HALF = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)  # every fp16, as numpy gives it
_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(F32)  # every bf16
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int32)


@njit
def _f16(lo, hi):
    """The fp16 of two little-endian bytes, as float32 (what numpy's float16 -> float32 gives). Without
    branches, so that it leaves the loops around it to LLVM's vectorizer."""
    e, m = (np.int32(hi) >> 2) & 31, np.int32(lo) | (np.int32(hi) & 3) << 8
    v = F64(m + (1024 if e != 0 else 0)) * _POW2[e]
    if e == 31 and m != 0:
        v = np.nan
    return F32(v * _SIGN[np.int32(hi) >> 7])


@njit
def nibbles(byte):
    """(low nibble, high nibble) of a uint8 as float32, in float32 arithmetic: exact, and in the products'
    own vector lanes (LLVM widens numba's integer operations to int64, two conversions and a narrowing a
    byte: 1.5x slower)."""
    f = F32(byte)
    high = np.floor(f * F32(0.0625))
    return f - F32(16) * high, high


@njit
def quarters(byte):
    """The four 2-bit fields of a uint8, lowest first, as float32 (as nibbles: exact, in float32 lanes)."""
    f = F32(byte)
    u1 = np.floor(f * F32(0.25))
    u2 = np.floor(u1 * F32(0.25))
    u3 = np.floor(u2 * F32(0.25))
    return f - F32(4) * u1, u1 - F32(4) * u2, u2 - F32(4) * u3, u3


@njit
def _u32(wr, o):
    return np.int64(wr[o]) | np.int64(wr[o + 1]) << 8 | np.int64(wr[o + 2]) << 16 | np.int64(wr[o + 3]) << 24


@fast
def sub_sums(x, width):
    """(T, Z / width) float32: the sum of x over each run of `width` values (0 width: (T, 0))."""
    T = x.shape[0]
    n = x.shape[1] // width if width else 0
    s = np.empty((T, n), dtype=F32)
    for t in range(T):
        for j in range(n):
            a = F32(0)
            for i in range(width):
                a += x[t, width * j + i]
            s[t, j] = a
    return s


# --- F32, F16, BF16: one value a "block" ----------------------------------------------------------------


@fast
def _row_f32(wr, xt, xs):
    f = wr.view(F32)
    a = F32(0)
    for i in range(xt.shape[0]):
        a += f[i] * xt[i]
    return F64(a)


@njit
def _block_f32(wr, o, y, yo):
    y[yo] = wr[o : o + 4].view(F32)[0]


@fast
def _row_f16(wr, xt, xs):
    h = wr.view(np.uint16)
    a = F32(0)
    for i in range(xt.shape[0]):
        a += _HALF[h[i]] * xt[i]
    return F64(a)


@njit
def _block_f16(wr, o, y, yo):
    y[yo] = _HALF[np.int32(wr[o]) | np.int32(wr[o + 1]) << 8]


@fast
def _row_bf16(wr, xt, xs):
    h = wr.view(np.uint16)
    a = F32(0)
    for i in range(xt.shape[0]):
        a += _BF16[h[i]] * xt[i]
    return F64(a)


@njit
def _block_bf16(wr, o, y, yo):
    y[yo] = _BF16[np.int32(wr[o]) | np.int32(wr[o + 1]) << 8]


# --- 32 values a block: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL --------------------------------------------
# Q8_0 (34 bytes): fp16 d, 32 int8 q; value d q.
# Q4_0 (18): fp16 d, 16 bytes: low nibbles values 0-15, high nibbles 16-31; value d (q - 8).
# Q4_1 (20): fp16 d, fp16 m, nibbles as Q4_0; value d q + m.
# Q5_0 (22): fp16 d, 32 bits qh (bit i: the fifth bit of value i), nibbles as Q4_0; value d (q - 16).
# Q5_1 (24): fp16 d, fp16 m, qh, nibbles; value d q + m.
# IQ4_NL (18): fp16 d, nibbles as Q4_0 indexing KVALUES; value d KVALUES[q].


@njit
def _row_q8_0(wr, xt, xs):
    """In 32 float32 lanes (the module's docstring)."""
    lanes = np.zeros(32, dtype=F32)
    for b in range(xt.shape[0] // 32):
        o, xo = 34 * b, 32 * b
        d = _f16(wr[o], wr[o + 1])
        for i in range(32):
            lanes[i] += d * F32(np.int8(wr[o + 2 + i])) * xt[xo + i]
    acc = 0.0
    for i in range(32):
        acc += F64(lanes[i])
    return acc


@njit
def _q4(wr, o, i, k):
    """Code i (0-31) of a 32-value block whose nibbles start at byte o, k its KVALUES (else less 8)."""
    v = np.int32(wr[o + (i & 15)])
    q = (v >> 4) if i >= 16 else (v & 15)
    return KVALUES[q] if k else q


@njit
def _row_4bit(wr, xt, xs, size, offset, kvalues):
    """Q4_0 (size 18, offset 8), Q4_1 (20, -1: a minimum), IQ4_NL (18, kvalues); in lanes as Q8_0."""
    lanes = np.zeros(32, dtype=F32)
    acc = 0.0
    for b in range(xt.shape[0] // 32):
        o, xo = size * b, 32 * b
        d = _f16(wr[o], wr[o + 1])
        for i in range(16):
            if kvalues:
                v = np.int32(wr[o + size - 16 + i])
                lo, hi = F32(KVALUES[v & 15]), F32(KVALUES[v >> 4])
            else:
                lo, hi = nibbles(wr[o + size - 16 + i])
                if offset > 0:
                    lo, hi = lo - F32(offset), hi - F32(offset)
            lanes[i] += d * lo * xt[xo + i]
            lanes[16 + i] += d * hi * xt[xo + 16 + i]
        if offset < 0:
            acc += F64(_f16(wr[o + 2], wr[o + 3])) * F64(xs[b])
    for i in range(32):
        acc += F64(lanes[i])
    return acc


@njit
def _row_q4_0(wr, xt, xs):
    return _row_4bit(wr, xt, xs, 18, 8, False)


@njit
def _row_q4_1(wr, xt, xs):
    return _row_4bit(wr, xt, xs, 20, -1, False)


@njit
def _row_iq4_nl(wr, xt, xs):
    return _row_4bit(wr, xt, xs, 18, 0, True)


@njit
def _block_q4_0(wr, o, y, yo):
    d = _f16(wr[o], wr[o + 1])
    for i in range(16):
        low, high = nibbles(wr[o + 2 + i])
        y[yo + i] = d * (low - F32(8))
        y[yo + 16 + i] = d * (high - F32(8))


@njit
def _block_q4_1(wr, o, y, yo):
    d, m = _f16(wr[o], wr[o + 1]), _f16(wr[o + 2], wr[o + 3])
    for i in range(16):
        low, high = nibbles(wr[o + 4 + i])
        y[yo + i] = d * low + m
        y[yo + 16 + i] = d * high + m


@njit
def _block_iq4_nl(wr, o, y, yo):
    d = _f16(wr[o], wr[o + 1])
    for i in range(32):
        y[yo + i] = d * F32(_q4(wr, o + 2, i, True))


@njit
def _row_5bit(wr, xt, xs, size, offset):
    """Q5_0 (size 22, offset 16), Q5_1 (24, -1: a minimum); in lanes as Q8_0."""
    lanes = np.zeros(32, dtype=F32)
    acc = 0.0
    for b in range(xt.shape[0] // 32):
        o, xo = size * b, 32 * b
        d, qh = _f16(wr[o], wr[o + 1]), _u32(wr, o + size - 20)
        for i in range(16):
            v = np.int32(wr[o + size - 16 + i])
            lo = (v & 15) | np.int32((qh >> i) & 1) << 4
            hi = (v >> 4) | np.int32((qh >> (i + 16)) & 1) << 4
            if offset > 0:
                lo, hi = lo - offset, hi - offset
            lanes[i] += d * F32(lo) * xt[xo + i]
            lanes[16 + i] += d * F32(hi) * xt[xo + 16 + i]
        if offset < 0:
            acc += F64(_f16(wr[o + 2], wr[o + 3])) * F64(xs[b])
    for i in range(32):
        acc += F64(lanes[i])
    return acc


@njit
def _row_q5_0(wr, xt, xs):
    return _row_5bit(wr, xt, xs, 22, 16)


@njit
def _row_q5_1(wr, xt, xs):
    return _row_5bit(wr, xt, xs, 24, -1)


@njit
def _q5(wr, o, i):
    """Code i (0-31) of a Q5_0/Q5_1 block whose qh starts at byte o."""
    return _q4(wr, o + 4, i, False) | np.int32((_u32(wr, o) >> i) & 1) << 4


@njit
def _block_q5_0(wr, o, y, yo):
    d = _f16(wr[o], wr[o + 1])
    for i in range(32):
        y[yo + i] = d * F32(_q5(wr, o + 2, i) - 16)


@njit
def _block_q5_1(wr, o, y, yo):
    d, m = _f16(wr[o], wr[o + 1]), _f16(wr[o + 2], wr[o + 3])
    for i in range(32):
        y[yo + i] = d * F32(_q5(wr, o + 4, i)) + m


# --- the kernels, by type: compiled by kernels.prepare() with their signatures -------------------------


def matvec_f32(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_f32(w[r], x[t], xs[t])


def dequant_f32(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 4):
            _block_f32(w[r], 4 * b, out[r], 1 * b)


def matvec_f16(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_f16(w[r], x[t], xs[t])


def dequant_f16(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 2):
            _block_f16(w[r], 2 * b, out[r], 1 * b)


def matvec_bf16(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_bf16(w[r], x[t], xs[t])


def dequant_bf16(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 2):
            _block_bf16(w[r], 2 * b, out[r], 1 * b)


def matvec_q8_0(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q8_0(w[r], x[t], xs[t])


def dequant_q8_0(w, out):  # (its blocks inline: the int8 view is taken once)
    codes = w.view(np.int8)  # (R, row_bytes): int8 to float32 directly (np.int8 of a byte goes through int64)
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 34):
            d = _f16(w[r, 34 * b], w[r, 34 * b + 1])
            for i in range(32):
                out[r, 32 * b + i] = F32(codes[r, 34 * b + 2 + i]) * d


def matvec_q4_0(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q4_0(w[r], x[t], xs[t])


def dequant_q4_0(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 18):
            _block_q4_0(w[r], 18 * b, out[r], 32 * b)


def matvec_q4_1(w, x, out):
    xs = sub_sums(x, 32)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q4_1(w[r], x[t], xs[t])


def dequant_q4_1(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 20):
            _block_q4_1(w[r], 20 * b, out[r], 32 * b)


def matvec_q5_0(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q5_0(w[r], x[t], xs[t])


def dequant_q5_0(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 22):
            _block_q5_0(w[r], 22 * b, out[r], 32 * b)


def matvec_q5_1(w, x, out):
    xs = sub_sums(x, 32)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q5_1(w[r], x[t], xs[t])


def dequant_q5_1(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 24):
            _block_q5_1(w[r], 24 * b, out[r], 32 * b)


def matvec_iq4_nl(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_iq4_nl(w[r], x[t], xs[t])


def dequant_iq4_nl(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 18):
            _block_iq4_nl(w[r], 18 * b, out[r], 32 * b)
