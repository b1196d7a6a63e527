"""Compact KV rows, byte for byte colibri's COLIKV2 (fp8) and COLIKV3 codec 1 (rotated int4).

A row is one cache vector of width W (an MLA c or k_pe row), stored little-endian as:

    codec  row bytes  layout                                        magic      h[7]
    f32    4W         W f32 (no scale)                              COLIKV1\\0  0
    fp8    W + 4      W e4m3 codes, then the row's f32 scale        COLIKV2\\0  1
    int4   W/2 + 4    W/2 bytes of 4-bit codes, then the f32 radius COLIKV3\\0  1<<8 | 4 (codec<<8 | bits)

The record these rows make up (the token, each layer's rows, the indexer keys): cache.py describes it.

fp8 (colibri c/kv_fp8.h, coli_kv8_quant_row): amax = max |x| over the row, NaN ignored. If amax <= 1e-35
(a zero, subnormal or all-NaN row) or amax > 3.4e38 (an inf), the row is W zero codes with scale 1.
Else code_i = e4m3(x_i * f32(448/amax)) (the factor rounded once, then one f32 product per value) and
scale = f32(amax/448). e4m3(v): the sign is bit 7; |v| < 2^-6 gives rint(|v| * 2^9) (ties to even; 8 is
the first normal, 0x08); else, with |v| = m * 2^e, m in [0.5, 1), k = rint(|v| * 2^(4-e)) in 8..16 (16
carries: k = 8, e + 1) and the code is (e+6)<<3 | k-8. Past 448, and inf, saturate to 0x7E | sign; NaN
is code 0; the NaN codes 0x7F/0xFF are never written. Decoded: value(code) * scale in f32, where a code
with E = bits 6..3, M = bits 2..0 is (1 + M/8) * 2^(E-7), or M * 2^-9 when E = 0.

int4 (c/kv_tq.h, coli_q4_quant_row; W a power of two, 2..2048, others are refused): radius = f32(sqrt(
the sum of x_i^2 in f64, in index order)). A radius <= 1e-35 or > 3.4e38 (NaN, inf): zero codes, radius
0. Else the row is rotated, y = H(D x): D_i = -1 where hash(0x9E3779B9 ^ i) is odd (`_signs`, a
splitmix32-style mix), H the Walsh-Hadamard butterflies in f32 and then one multiply by f32(1/sqrt(W)).
Code_i is the nearest of the 16 `Q4_LEVELS` (N(0,1) Lloyd-Max) to y_i * f32(sqrt(W)/radius), by f32
distance, the lower code on a tie; value i is the low nibble of byte i/2 when i is even, else the high.
Decoded: x = D(H(levels[code] * f32(radius/sqrt(W)))).

Reading bytes back (`decode_rows`) does what colibri's loader does: an fp8 scale or an int4 radius that is
not in (0, 3.4e38) gives a zero row, and an fp8 NaN code reads as 0. fp8 re-encodes its own output to
the same bytes; int4 does not (a decoded row's norm is not the stored radius, so re-encoding changes the
radius, and the codes too when the row had values past the outer levels): a cache keeps the bytes it
wrote and decodes them, and never re-encodes what it decoded.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
CODECS = ("f32", "fp8", "int4")
TAGS = {"f32": (b"COLIKV1\0", 0), "fp8": (b"COLIKV2\0", 1), "int4": (b"COLIKV3\0", 1 << 8 | 4)}  # magic, h[7]
SEED = 0x9E3779B9
MAX_WIDTH = 2048
Q4_LEVELS = np.array([-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
                      0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733], dtype=F32)
_TINY, _HUGE = F32(1e-35), F32(3.4e38)  # a row's amax (fp8) or norm (int4) must be above _TINY, at most _HUGE


def width_problem(width: int, codec: str) -> str | None:
    """Why rows of `width` values cannot be kept in `codec` (an unknown codec; int4 rows whose width is
    not a power of two, 2 to 2048), or None."""
    if codec not in CODECS:
        return f"unknown KV format {codec!r}: expected one of {', '.join(CODECS)}"
    if width < 1:
        return f"a KV row has at least one value, not {width}"
    if codec == "int4" and (width < 2 or width > MAX_WIDTH or width & (width - 1)):
        return (f"the int4 KV format needs rows whose width is a power of two (2 to {MAX_WIDTH}); "
                f"this model has rows of {width}: use fp8 or f32")
    return None


def row_bytes(width: int, codec: str) -> int:
    """Bytes of one stored row of `width` values, with its 4-byte scale or radius (f32 rows have none).
    ValueError where `width_problem` says why not."""
    problem = width_problem(width, codec)
    if problem:
        raise ValueError(problem)
    return {"f32": 4 * width, "fp8": width + 4, "int4": width // 2 + 4}[codec]


def record_bytes(n_layer: int, a_width: int, b_width: int, codec: str, index_hd: int = 0,
                 n_index_layers: int = 0) -> int:
    """One token's record: int32 token, per layer an A row and a B row in `codec` (MLA: c, k_pe), then
    n_index_layers f32 Ic rows of index_hd (f32 is `colichat.engine.cache.record_bytes`)."""
    return 4 + n_layer * (row_bytes(a_width, codec) + row_bytes(b_width, codec)) + n_index_layers * index_hd * 4


# ---- fp8 e4m3 -------------------------------------------------------------------------------------------

def _fp8_values() -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e > 0, (1 + m / 8) * 2.0 ** (e - 7), m * 2.0**-9)
    v[(b & 0x7F) == 0x7F] = 0  # the NaN codes, never written
    return np.where(b & 0x80, -v, v).astype(F32)


FP8_VALUES = _fp8_values()  # (256,) f32: each code's value before the row's scale (colibri's coli_fp8_lut)


def fp8_encode(v: np.ndarray) -> np.ndarray:
    """f32 values (any shape) -> uint8 e4m3 codes, as colibri's coli_fp8_enc: the nearest code, ties to
    the even one, past 448 (and inf) saturated to 0x7E, NaN -> 0, the sign kept (-0.0 -> 0x80)."""
    v = np.asarray(v, dtype=F32)
    bits = v.view(np.uint32)
    a = np.abs(v)
    body = bits & np.uint32(0x7FFFFFFF)
    with np.errstate(over="ignore"):  # uint32 wrap-around, only where the normal path is not taken
        # normal e4m3 (|v| >= 2^-6): round the f32 mantissa to 3 bits, ties to even (a carry moves into
        # the exponent), then rebias the exponent from 127 to 7
        kept = (body + np.uint32(0x7FFFF) + ((body >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
        normal = (kept - np.uint32(120 << 3)).astype(np.uint8)
    code = np.where(a < F32(2.0**-6), np.rint(np.fmin(a, F32(2.0**-6)) * F32(512)).astype(np.uint8), normal)
    code = np.where(a <= F32(448), code, np.uint8(0x7E)) | ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    return np.where(np.isnan(a), np.uint8(0), code)


def _fp8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # x (N, W) f32 -> codes (N, W) uint8, scale (N,) f32
    a = np.abs(x)
    amax = np.where(np.isnan(a), F32(0), a).max(axis=1)
    inert = ~(amax > _TINY) | (amax > _HUGE)
    amax = np.where(inert, F32(448), amax)
    codes = fp8_encode(x * (F32(448) / amax)[:, None])
    codes[inert] = 0
    return codes, np.where(inert, F32(1), amax / F32(448))


# ---- rotated int4 ---------------------------------------------------------------------------------------

def _signs(n: int) -> np.ndarray:
    """(n,) f32 of +-1: the diagonal D of colibri's rotation (coli_tq_sign with COLI_TQ_SEED)."""
    x = (np.uint32(SEED) ^ np.arange(n, dtype=np.uint32)) + np.uint32(0x9E3779B9)
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    x = (x ^ (x >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return np.where((x ^ (x >> np.uint32(16))) & np.uint32(1), F32(-1), F32(1))


def _fwht(a: np.ndarray) -> np.ndarray:
    # a (N, W) f32 -> (N, W) f32: colibri's butterflies (the same f32 sums, stage by stage), then 1/sqrt(W)
    n, w = a.shape
    a, b = a.copy(), np.empty_like(a)
    span = 1
    with np.errstate(over="ignore", invalid="ignore"):  # a row near 3.4e38 overflows here, in colibri too
        while span < w:
            pairs, out = a.reshape(n, w // (2 * span), 2, span), b.reshape(n, w // (2 * span), 2, span)
            np.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
            np.subtract(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
            a, b, span = b, a, span * 2
        a *= F32(1) / np.sqrt(F32(w))
    return a


def _int4_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # x (N, W) f32 -> codes (N, W/2) uint8, radius (N,) f32
    with np.errstate(invalid="ignore", over="ignore"):
        x64 = x.astype(np.float64)
        norm = np.sqrt(np.cumsum(x64 * x64, axis=1)[:, -1]).astype(F32)  # cumsum adds in order, like colibri
        live = (norm > _TINY) & (norm <= _HUGE)
        radius = np.where(live, norm, F32(0))
        v = _fwht(x * _signs(x.shape[1])) * (np.sqrt(F32(x.shape[1])) / np.where(live, norm, F32(1)))[:, None]
        # colibri scans the 16 levels for a strictly smaller f32 distance |v - level| (from 1e30 down), so
        # the lower code wins a tie. Only the two levels around v can be nearest (|v| <= sqrt(W)): compare those.
        code = np.zeros(v.shape, np.uint8)
        for level in Q4_LEVELS[1:]:
            code += v >= level  # the highest level at or below v (0 below them all)
        below, above = np.abs(v - Q4_LEVELS[code]), np.abs(v - Q4_LEVELS[np.minimum(code + 1, 15)])
        code += (above < below) & (code < 15)
        code = np.where(np.fmin(below, above) < F32(1e30), code, np.uint8(0))  # NaN, inf (overflow): code 0
    code[~live] = 0
    return code[:, 0::2] | (code[:, 1::2] << 4), radius


# ---- rows -----------------------------------------------------------------------------------------------

def encode_rows(rows: np.ndarray, codec: str) -> np.ndarray:
    """(N, W) f32 -> (N, row_bytes(W, codec)) uint8: each row as a record holds it."""
    x = np.ascontiguousarray(rows, dtype=F32)
    n, width = x.shape
    out = np.empty((n, row_bytes(width, codec)), np.uint8)
    if codec == "f32":
        out[:] = x.astype("<f4").view(np.uint8)
        return out
    codes, scale = _fp8_rows(x) if codec == "fp8" else _int4_rows(x)
    out[:, :-4], out[:, -4:] = codes, scale.astype("<f4").view(np.uint8).reshape(n, 4)
    return out


def decode_rows(data: np.ndarray, width: int, codec: str) -> np.ndarray:
    """(N, row_bytes(width, codec)) uint8 -> (N, width) f32, as colibri reads them from a file: a scale or
    radius outside (0, 3.4e38) gives a zero row, and an fp8 NaN code (0x7F, 0xFF) reads as 0."""
    data = np.asarray(data, dtype=np.uint8).reshape(-1, row_bytes(width, codec))
    if codec == "f32":
        return data.copy().view("<f4").astype(F32)
    codes, scale = data[:, :-4], data[:, -4:].copy().view("<f4").astype(F32)[:, 0]
    with np.errstate(invalid="ignore", over="ignore"):  # a scale near 3.4e38 gives inf, in colibri too
        good = (scale > 0) & (scale < _HUGE)
        out = np.zeros((len(data), width), F32)
        if codec == "fp8":
            codes = np.where((codes[good] & 0x7F) == 0x7F, 0, codes[good])
            out[good] = FP8_VALUES[codes] * scale[good][:, None]
        elif good.any():
            nibbles = np.stack([codes[good] & 15, codes[good] >> 4], axis=2).reshape(-1, width)
            out[good] = _fwht(Q4_LEVELS[nibbles] * (scale[good] / np.sqrt(F32(width)))[:, None]) * _signs(width)
    return out


def encode_row(x: np.ndarray, codec: str) -> np.ndarray:
    """(W,) f32 -> (row_bytes,) uint8."""
    return encode_rows(np.asarray(x, dtype=F32)[None, :], codec)[0]


def decode_row(data: np.ndarray, width: int, codec: str) -> np.ndarray:
    """(row_bytes,) uint8 -> (W,) f32."""
    return decode_rows(np.asarray(data, dtype=np.uint8)[None, :], width, codec)[0]


def round_trip(rows: np.ndarray, codec: str) -> np.ndarray:
    """(..., W) f32 -> the same shape: what a file in `codec` gives back for these rows."""
    rows = np.asarray(rows, dtype=F32)
    if codec == "f32":
        return rows.copy()
    flat = rows.reshape(-1, rows.shape[-1])
    return decode_rows(encode_rows(flat, codec), rows.shape[-1], codec).reshape(rows.shape)
