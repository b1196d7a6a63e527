"""The compiled bodies of kernels.py for 256-value super-blocks: the K-quants (Q2_K to Q6_K) and IQ4_XS.

As kernel_bodies.py (its docstring: the shapes, the order of the sums, the fastmath rule), per type:
`_row_<type>` the dot product of one row with one row of x, `_block_<type>` one block's values, and the
kernels `matvec_<type>` and `dequant_<type>` that kernels.prepare() compiles.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .kernel_bodies import F32, F64, KVALUES, _f16, fast, nibbles, quarters, sub_sums

# --- K-quants: 256 values a block, in sub-blocks of 16 or 32 (layouts: dequant.py and gguf-py) ------------
# Q2_K (84 bytes): 16 scale bytes (low nibble sc, high nibble m, one a 16-value sub-block), 64 bytes of
#   2-bit codes, fp16 d, fp16 dmin. Value v = 128 h + 32 s + l (l < 32): (qs[32 h + l] >> 2 s) & 3, in
#   sub-block v // 16; value (d sc) q - (dmin m).
# Q3_K (110): 32 bytes hmask, 64 bytes of 2-bit codes (as Q2_K), 12 bytes of six-bit scales, fp16 d. Code
#   (the 2 bits) less 4 unless bit 4 h + s of hmask[l] is set; scale i: nibble of byte i % 8 (high for i
#   >= 8), its two high bits at 2 (i // 4) of byte 8 + i % 4, less 32; value (d sc) q.
# Q4_K (144): fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of nibbles: bytes 32 c .. 32 c + 31 hold
#   sub-block 2 c in their low nibbles, 2 c + 1 in their high ones; value (d sc) q - (dmin m).
# Q5_K (176): as Q4_K with 32 bytes qh before the nibbles: bit j of qh[l] is value l of sub-block j's fifth.
# Q6_K (210): 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d. Value v = 128 h + 32 g + l: low nibble
#   (ql[64 h + 32 (g & 1) + l] >> 4 (g >> 1)) & 15, two high bits (qh[32 h + l] >> 2 g) & 3, less 32;
#   value (d sc) q, sc the scale of v // 16.
# IQ4_XS (136): fp16 d, 16 bits scales_h, 4 bytes scales_l, 128 bytes of nibbles (sub-block j: bytes 16 j ..
#   16 j + 15, low nibbles its values 0-15, high ones 16-31) indexing KVALUES; six-bit ls: nibble j of
#   scales_l, bits 2 j of scales_h above it; value (d (ls - 32)) KVALUES[q].


@njit
def _scale_min_k4(wr, s, j):
    """(sc, m) of sub-block j of a Q4_K/Q5_K block whose 12 scale bytes start at byte s."""
    if j < 4:
        return np.int32(wr[s + j] & 63), np.int32(wr[s + j + 4] & 63)
    return (np.int32((wr[s + j + 4] & 15) | ((wr[s + j - 4] >> 6) << 4)),
            np.int32((wr[s + j + 4] >> 4) | ((wr[s + j] >> 6) << 4)))


@njit
def _scale_q3_k(wr, s, i):
    """The signed six-bit scale of sub-block i of a Q3_K block whose 12 scale bytes start at byte s."""
    low = (np.int32(wr[s + (i & 7)]) >> (4 * (i >> 3))) & 15
    return (low | ((np.int32(wr[s + 8 + (i & 3)]) >> (2 * (i >> 2))) & 3) << 4) - 32


@fast
def _row_q2_k(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 84 * b, 256 * b
        d, dmin = F64(_f16(wr[o + 80], wr[o + 81])), F64(_f16(wr[o + 82], wr[o + 83]))
        for i in range(16):  # sub-block i: h = i // 8, s = (i // 2) % 4, l from 16 (i % 2)
            q, shift, v = o + 16 + 32 * (i >> 3) + 16 * (i & 1), 2 * ((i >> 1) & 3), xo + 16 * i
            a = F32(0)
            for k in range(16):
                a += F32((np.int32(wr[q + k]) >> shift) & 3) * xt[v + k]
            sc = np.int32(wr[o + i])
            acc += d * (sc & 15) * F64(a) - dmin * (sc >> 4) * F64(xs[16 * b + i])
    return acc


@njit
def _block_q2_k(wr, o, y, yo):
    d, dmin = _f16(wr[o + 80], wr[o + 81]), _f16(wr[o + 82], wr[o + 83])
    for i in range(16):
        q, shift, sc = o + 16 + 32 * (i >> 3) + 16 * (i & 1), 2 * ((i >> 1) & 3), np.int32(wr[o + i])
        dl, ml = d * F32(sc & 15), dmin * F32(sc >> 4)
        for k in range(16):
            y[yo + 16 * i + k] = dl * F32((np.int32(wr[q + k]) >> shift) & 3) - ml


@njit
def _q3(wr, o, i, k):
    """Code k (0-15) of sub-block i of the Q3_K block at byte o."""
    h, s, l = i >> 3, (i >> 1) & 3, 16 * (i & 1) + k
    low = (np.int32(wr[o + 32 + 32 * h + l]) >> (2 * s)) & 3
    return low - 4 + 4 * ((np.int32(wr[o + l]) >> (4 * h + s)) & 1)


@fast
def _row_q3_k(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 110 * b, 256 * b
        a = 0.0
        for g in range(8):  # values 32 g .. 32 g + 31: h = g // 4, s = g % 4; sub-blocks 2 g, 2 g + 1
            q, shift, bit, v = o + 32 + 32 * (g >> 2), 2 * (g & 3), g, xo + 32 * g
            p0 = p1 = F32(0)
            for k in range(16):
                c0 = ((np.int32(wr[q + k]) >> shift) & 3) - 4 + 4 * ((np.int32(wr[o + k]) >> bit) & 1)
                c1 = ((np.int32(wr[q + 16 + k]) >> shift) & 3) - 4 + 4 * ((np.int32(wr[o + 16 + k]) >> bit) & 1)
                p0 += F32(c0) * xt[v + k]
                p1 += F32(c1) * xt[v + 16 + k]
            a += F64(_scale_q3_k(wr, o + 96, 2 * g)) * F64(p0) + F64(_scale_q3_k(wr, o + 96, 2 * g + 1)) * F64(p1)
        acc += F64(_f16(wr[o + 108], wr[o + 109])) * a
    return acc


@njit
def _block_q3_k(wr, o, y, yo):
    d = _f16(wr[o + 108], wr[o + 109])
    for i in range(16):
        dl = d * F32(_scale_q3_k(wr, o + 96, i))
        for k in range(16):
            y[yo + 16 * i + k] = dl * F32(_q3(wr, o, i, k))


@fast
def _row_q4_k(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 144 * b, 256 * b
        d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
        for c in range(4):  # 32 bytes: sub-blocks 2 c (low nibbles) and 2 c + 1 (high)
            q, v = o + 16 + 32 * c, xo + 64 * c
            p0 = p1 = F32(0)
            for k in range(32):
                low, high = nibbles(wr[q + k])
                p0 += low * xt[v + k]
                p1 += high * xt[v + 32 + k]
            sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
            sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
            acc += d * sc0 * F64(p0) - dmin * m0 * F64(xs[8 * b + 2 * c])
            acc += d * sc1 * F64(p1) - dmin * m1 * F64(xs[8 * b + 2 * c + 1])
    return acc


@fast
def _row_q5_k(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 176 * b, 256 * b
        d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
        for c in range(4):  # as Q4_K, the fifth bits: bits 2 c and 2 c + 1 of qh[k]
            q, v = o + 48 + 32 * c, xo + 64 * c
            p0 = p1 = F32(0)
            for k in range(32):
                byte, high = np.int32(wr[q + k]), np.int32(wr[o + 16 + k]) >> (2 * c)
                p0 += F32((byte & 15) | (high & 1) << 4) * xt[v + k]
                p1 += F32((byte >> 4) | (high & 2) << 3) * xt[v + 32 + k]
            sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
            sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
            acc += d * sc0 * F64(p0) - dmin * m0 * F64(xs[8 * b + 2 * c])
            acc += d * sc1 * F64(p1) - dmin * m1 * F64(xs[8 * b + 2 * c + 1])
    return acc


@njit
def _block_k4(wr, o, y, yo, high):
    d, dmin = _f16(wr[o], wr[o + 1]), _f16(wr[o + 2], wr[o + 3])
    q0 = 48 if high else 16
    for j in range(8):
        sc, m = _scale_min_k4(wr, o + 4, j)
        ds, dm = d * F32(sc), dmin * F32(m)
        q, shift = o + q0 + 32 * (j >> 1), 4 * (j & 1)
        for k in range(32):
            code = (np.int32(wr[q + k]) >> shift) & 15
            if high:
                code |= ((np.int32(wr[o + 16 + k]) >> j) & 1) << 4
            y[yo + 32 * j + k] = ds * F32(code) - dm


@njit
def _block_q4_k_pairs(wr, o, y, yo):
    """Q4_K as _block_k4, a byte's two codes at once (nibbles): the same values, in vector lanes."""
    d, dmin = _f16(wr[o], wr[o + 1]), _f16(wr[o + 2], wr[o + 3])
    for c in range(4):
        sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
        sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
        ds0, dm0, ds1, dm1 = d * F32(sc0), dmin * F32(m0), d * F32(sc1), dmin * F32(m1)
        q, v = o + 16 + 32 * c, yo + 64 * c
        for k in range(32):
            low, high = nibbles(wr[q + k])
            y[v + k] = ds0 * low - dm0
            y[v + 32 + k] = ds1 * high - dm1


@njit
def _block_q4_k(wr, o, y, yo):
    _block_q4_k_pairs(wr, o, y, yo)


@njit
def _block_q5_k(wr, o, y, yo):
    _block_k4(wr, o, y, yo, True)


@njit
def _q6(low, top):
    """A Q6_K code, less 32: four low bits and two high bits (both in place, as int32)."""
    return F32((low & 15) | top) - F32(32)


@fast
def _row_q6_k(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 210 * b, 256 * b
        a = 0.0
        for h in range(2):  # 128 values, in 8 sub-blocks of 16: p<g><e> the one of group g, half e
            ql, qh, v, sc = o + 64 * h, o + 128 + 32 * h, xo + 128 * h, o + 192 + 8 * h
            p00 = p01 = p10 = p11 = p20 = p21 = p30 = p31 = F32(0)
            for k in range(16):
                a0, b0, t0 = np.int32(wr[ql + k]), np.int32(wr[ql + 32 + k]), np.int32(wr[qh + k])
                a1, b1, t1 = np.int32(wr[ql + 16 + k]), np.int32(wr[ql + 48 + k]), np.int32(wr[qh + 16 + k])
                p00 += _q6(a0, (t0 & 3) << 4) * xt[v + k]
                p01 += _q6(a1, (t1 & 3) << 4) * xt[v + 16 + k]
                p10 += _q6(b0, (t0 & 12) << 2) * xt[v + 32 + k]
                p11 += _q6(b1, (t1 & 12) << 2) * xt[v + 48 + k]
                p20 += _q6(a0 >> 4, t0 & 48) * xt[v + 64 + k]
                p21 += _q6(a1 >> 4, t1 & 48) * xt[v + 80 + k]
                p30 += _q6(b0 >> 4, (t0 & 192) >> 2) * xt[v + 96 + k]
                p31 += _q6(b1 >> 4, (t1 & 192) >> 2) * xt[v + 112 + k]
            for i, p in enumerate((p00, p01, p10, p11, p20, p21, p30, p31)):
                a += F64(np.int8(wr[sc + i])) * F64(p)
        acc += F64(_f16(wr[o + 208], wr[o + 209])) * a
    return acc


@njit
def _block_q6_k(wr, o, y, yo):
    """In the order of _row_q6_k: each k reads the bytes of the four codes 16 e + k, 32 + 16 e + k, 64 + ...
    and 96 + ... of half h, and takes them apart in float32 (nibbles, quarters): exact, in lanes across k."""
    d = _f16(wr[o + 208], wr[o + 209])
    for h in range(2):
        ql, qh, v, sc = o + 64 * h, o + 128 + 32 * h, yo + 128 * h, o + 192 + 8 * h
        for e in range(2):  # values 16 e + k of each group
            s0, s1 = d * F32(np.int8(wr[sc + e])), d * F32(np.int8(wr[sc + 2 + e]))
            s2, s3 = d * F32(np.int8(wr[sc + 4 + e])), d * F32(np.int8(wr[sc + 6 + e]))
            for k in range(16):
                a_lo, a_hi = nibbles(wr[ql + 16 * e + k])
                b_lo, b_hi = nibbles(wr[ql + 32 + 16 * e + k])
                t0, t1, t2, t3 = quarters(wr[qh + 16 * e + k])
                y[v + 16 * e + k] = s0 * (a_lo + F32(16) * t0 - F32(32))
                y[v + 32 + 16 * e + k] = s1 * (b_lo + F32(16) * t1 - F32(32))
                y[v + 64 + 16 * e + k] = s2 * (a_hi + F32(16) * t2 - F32(32))
                y[v + 96 + 16 * e + k] = s3 * (b_hi + F32(16) * t3 - F32(32))


@njit
def _scale_iq4_xs(wr, o, j):
    ls = (np.int32(wr[o + 4 + (j >> 1)]) >> (4 * (j & 1))) & 15
    return (ls | ((np.int32(wr[o + 2 + (j >> 2)]) >> (2 * (j & 3))) & 3) << 4) - 32


@fast
def _row_iq4_xs(wr, xt, xs):
    acc = 0.0
    for b in range(xt.shape[0] // 256):
        o, xo = 136 * b, 256 * b
        a = 0.0
        for j in range(8):
            q, v = o + 8 + 16 * j, xo + 32 * j
            p = F32(0)
            for k in range(16):
                c = np.int32(wr[q + k])
                p += F32(KVALUES[c & 15]) * xt[v + k] + F32(KVALUES[c >> 4]) * xt[v + 16 + k]
            a += F64(_scale_iq4_xs(wr, o, j)) * F64(p)
        acc += F64(_f16(wr[o], wr[o + 1])) * a
    return acc


@njit
def _block_iq4_xs(wr, o, y, yo):
    d = _f16(wr[o], wr[o + 1])
    for j in range(8):
        dl = d * F32(_scale_iq4_xs(wr, o, j))
        for k in range(16):
            c = np.int32(wr[o + 8 + 16 * j + k])
            y[yo + 32 * j + k] = dl * F32(KVALUES[c & 15])
            y[yo + 32 * j + 16 + k] = dl * F32(KVALUES[c >> 4])


# --- the kernels, by type: compiled by kernels.prepare() with their signatures -------------------------


def matvec_q2_k(w, x, out):
    xs = sub_sums(x, 16)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q2_k(w[r], x[t], xs[t])


def dequant_q2_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 84):
            _block_q2_k(w[r], 84 * b, out[r], 256 * b)


def matvec_q3_k(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q3_k(w[r], x[t], xs[t])


def dequant_q3_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 110):
            _block_q3_k(w[r], 110 * b, out[r], 256 * b)


def matvec_q4_k(w, x, out):
    xs = sub_sums(x, 32)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q4_k(w[r], x[t], xs[t])


def dequant_q4_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 144):
            _block_q4_k(w[r], 144 * b, out[r], 256 * b)


def matvec_q5_k(w, x, out):
    xs = sub_sums(x, 32)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q5_k(w[r], x[t], xs[t])


def dequant_q5_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 176):
            _block_q5_k(w[r], 176 * b, out[r], 256 * b)


def matvec_q6_k(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q6_k(w[r], x[t], xs[t])


def dequant_q6_k(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 210):
            _block_q6_k(w[r], 210 * b, out[r], 256 * b)


def matvec_iq4_xs(w, x, out):
    xs = sub_sums(x, 0)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_iq4_xs(w[r], x[t], xs[t])


def dequant_iq4_xs(w, out):
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 136):
            _block_iq4_xs(w[r], 136 * b, out[r], 256 * b)
