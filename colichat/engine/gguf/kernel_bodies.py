"""The compiled bodies of kernels.py: plain Python over numpy arrays, compiled by numba (kernels.prepare()).

Imported only once numba is known to be there, and only by kernels.py. The helpers (`_f16`, the dots)
are njit functions compiled into the kernels that call them; the kernels themselves (`matvec_*`,
`dequant_*`) are left undecorated here: kernels.prepare() compiles each with its signature, nogil,
cached on disk under colichat's cache directory.

Shapes: w (R, row_bytes) uint8, whole blocks; x (T, Z) float32; out (T, R) or (R, Z) float32.
Every out[t, r] is summed in one fixed order from w[r] and x[t] alone: within a sub-block, 8 float32 lanes
(lane k takes values k, k+8, ...), added pairwise at the end; sub-blocks then blocks into a float64
accumulator, in order. Nothing depends on T, on which rows a call gets, or on the thread.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
F64 = np.float64
_POW2 = np.array([2.0 ** (e - 25) for e in range(32)], dtype=F64)  # fp16: (1024 + m) * 2^(e - 25)


@njit
def _f16(lo, hi):
    """The fp16 of two little-endian bytes, as float32 (exactly what numpy's float16 -> float32 gives)."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = m * 5.960464477539063e-08  # subnormal: m * 2^-24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = (1024 + m) * _POW2[e]
    return F32(-v if h & 0x8000 else v)


@njit
def _lanes(a0, a1, a2, a3, a4, a5, a6, a7):
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


# --- Q8_0: blocks of 32 values in 34 bytes: fp16 d, 32 int8 q; value d * q --------------------------------


@njit
def _dot_i8(w, o, x, xo, n):
    """sum over i < n (a multiple of 8) of int8(w[o + i]) * x[xo + i], in 8 float32 lanes."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = F32(0)
    for i in range(0, n, 8):
        a0 += F32(np.int8(w[o + i])) * x[xo + i]
        a1 += F32(np.int8(w[o + i + 1])) * x[xo + i + 1]
        a2 += F32(np.int8(w[o + i + 2])) * x[xo + i + 2]
        a3 += F32(np.int8(w[o + i + 3])) * x[xo + i + 3]
        a4 += F32(np.int8(w[o + i + 4])) * x[xo + i + 4]
        a5 += F32(np.int8(w[o + i + 5])) * x[xo + i + 5]
        a6 += F32(np.int8(w[o + i + 6])) * x[xo + i + 6]
        a7 += F32(np.int8(w[o + i + 7])) * x[xo + i + 7]
    return _lanes(a0, a1, a2, a3, a4, a5, a6, a7)


def matvec_q8_0(w, x, out):
    R, nb = w.shape[0], w.shape[1] // 34
    for r in range(R):
        for t in range(x.shape[0]):
            acc = 0.0
            for b in range(nb):
                o = 34 * b
                acc += F64(_f16(w[r, o], w[r, o + 1])) * F64(_dot_i8(w[r], o + 2, x[t], 32 * b, 32))
            out[t, r] = acc


def dequant_q8_0(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 34):
            o = 34 * b
            d = _f16(w[r, o], w[r, o + 1])
            for i in range(32):
                out[r, 32 * b + i] = F32(np.int8(w[r, o + 2 + i])) * d


# --- Q4_K: blocks of 256 in 144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of nibbles ---------------
# Sub-block j (32 values) has six-bit scale sc and min m (_scale_min_k4); bytes 16 + 32c .. 16 + 32c + 31 hold
# sub-block 2c in their low nibbles and 2c + 1 in their high ones. Value (d sc) q - (dmin m).


@njit
def _scale_min_k4(w, o, j):
    """(sc, m) of sub-block j of the Q4_K/Q5_K block at byte o (its 12 scale bytes at o + 4)."""
    s = o + 4
    if j < 4:
        return w[s + j] & 63, w[s + j + 4] & 63
    return (w[s + j + 4] & 15) | ((w[s + j - 4] >> 6) << 4), (w[s + j + 4] >> 4) | ((w[s + j] >> 6) << 4)


@njit
def _dot_u4(w, o, shift, x, xo):
    """sum over i < 32 of ((w[o + i] >> shift) & 15) * x[xo + i], in 8 float32 lanes."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = F32(0)
    for i in range(0, 32, 8):
        a0 += F32((w[o + i] >> shift) & 15) * x[xo + i]
        a1 += F32((w[o + i + 1] >> shift) & 15) * x[xo + i + 1]
        a2 += F32((w[o + i + 2] >> shift) & 15) * x[xo + i + 2]
        a3 += F32((w[o + i + 3] >> shift) & 15) * x[xo + i + 3]
        a4 += F32((w[o + i + 4] >> shift) & 15) * x[xo + i + 4]
        a5 += F32((w[o + i + 5] >> shift) & 15) * x[xo + i + 5]
        a6 += F32((w[o + i + 6] >> shift) & 15) * x[xo + i + 6]
        a7 += F32((w[o + i + 7] >> shift) & 15) * x[xo + i + 7]
    return _lanes(a0, a1, a2, a3, a4, a5, a6, a7)


@njit
def sub_sums(x, width):
    """(T, Z / width) float32: the sums of x over each run of `width` values, in 8 lanes (width 16 or 32)."""
    T, n = x.shape[0], x.shape[1] // width
    s = np.empty((T, n), dtype=F32)
    for t in range(T):
        for j in range(n):
            o = j * width
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = F32(0)
            for i in range(0, width, 8):
                a0 += x[t, o + i]
                a1 += x[t, o + i + 1]
                a2 += x[t, o + i + 2]
                a3 += x[t, o + i + 3]
                a4 += x[t, o + i + 4]
                a5 += x[t, o + i + 5]
                a6 += x[t, o + i + 6]
                a7 += x[t, o + i + 7]
            s[t, j] = _lanes(a0, a1, a2, a3, a4, a5, a6, a7)
    return s


def matvec_q4_k(w, x, out):
    R, nb = w.shape[0], w.shape[1] // 144
    xs = sub_sums(x, 32)  # (T, Z / 32)
    for r in range(R):
        for t in range(x.shape[0]):
            acc = 0.0
            for b in range(nb):
                o = 144 * b
                d, dmin = F64(_f16(w[r, o], w[r, o + 1])), F64(_f16(w[r, o + 2], w[r, o + 3]))
                for j in range(8):
                    sc, m = _scale_min_k4(w[r], o, j)
                    dot = _dot_u4(w[r], o + 16 + 32 * (j >> 1), 4 * (j & 1), x[t], 256 * b + 32 * j)
                    acc += d * sc * F64(dot) - dmin * m * F64(xs[t, 8 * b + j])
            out[t, r] = acc


def dequant_q4_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 144):
            o = 144 * b
            d, dmin = _f16(w[r, o], w[r, o + 1]), _f16(w[r, o + 2], w[r, o + 3])
            for j in range(8):
                sc, m = _scale_min_k4(w[r], o, j)
                ds, dm = d * F32(sc), dmin * F32(m)
                q, shift = o + 16 + 32 * (j >> 1), 4 * (j & 1)
                for i in range(32):
                    out[r, 256 * b + 32 * j + i] = ds * F32((w[r, q + i] >> shift) & 15) - dm
