"""Dequantizers for the quant types most GGUFs keep their large matrices in (Q8_0, Q4_0, IQ4_XS and the
K-quants of the common "Q4_K_M"-style mixes): the same float32 values as gguf-py's gguf.quants.dequantize,
bit for bit (the same float operations in the same order), about 10x faster than gguf-py's K-quants and
15-40x its Q8_0, Q4_0 and IQ4_XS. Routed experts of MoE models are dequantized on every expert-cache miss,
so this speed is decode and prefill speed there. Other types go to gguf.quants.dequantize (tensors.py, ffn.py).

Each function takes the raw bytes of whole blocks (any shape whose size is a multiple of the block size)
and returns a flat float32 array; QK_K = 256 values per K-quant block. Given `out` (a C-contiguous float32
array of exactly that many values, such as a slot of an expert cache's slab) it writes there instead of
allocating, and returns it flat.

How, in numpy on one thread: the blocks go in chunks of about CHUNK values, so that intermediates stay in
cache and the output goes to memory once. In a chunk, codes are unpacked by whole-chunk integer
operations (nibbles split with 64-bit masks, high bits shifted in place), cast to float32 straight into the
output in value order, then multiplied by each sub-block's scale and less its minimum, both repeated to full
length (np.repeat): numpy's per-row cost on rows of 16 or 32 values, not arithmetic, is what bounds this.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
CHUNK = 1 << 18  # float32 values per chunk (1 MiB)
_LO4 = np.uint64(0x0F0F0F0F0F0F0F0F)  # the low nibble of each of 8 bytes


def _blocks(data: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)


def _out(out: np.ndarray | None, n: int) -> np.ndarray:
    if out is None:
        return np.empty(n, dtype=F32)
    if out.dtype != F32 or out.size != n or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous float32 array of {n} values")
    return out.reshape(-1)


def _chunks(n: int, per_block: int):
    step = max(1, CHUNK // per_block)
    return ((i, min(n, i + step)) for i in range(0, n, step))


def _f16(b: np.ndarray, word: int) -> np.ndarray:
    """fp16 at bytes 2*word of each block (row of b) -> (blocks,) float32."""
    return b.view(np.float16)[:, word].astype(F32)


def _finish(o: np.ndarray, q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None = None) -> None:
    """o (chunk of the output) = q (codes, any view of o's shape) * scale [- minimum]; scale and minimum are
    (blocks, sub-blocks), each applying to an equal run of values of a block."""
    np.copyto(o, q, casting="unsafe")
    flat = o.reshape(scale.shape[0], -1)
    run = flat.shape[1] // scale.shape[1]
    flat *= np.repeat(scale, run, axis=1)
    if minimum is not None:
        flat -= np.repeat(minimum, run, axis=1)


def _nibbles(r: np.ndarray, lh: np.ndarray) -> np.ndarray:
    """r (blocks, words) uint64 -> lh[:, :blocks] as bytes: (low nibbles, high nibbles) of every byte."""
    k = r.shape[0]
    np.bitwise_and(r, _LO4, out=lh[0, :k])
    np.right_shift(r, 4, out=lh[1, :k])
    lh[1, :k] &= _LO4
    return lh[:, :k].view(np.uint8)


def q8_0(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of 32: fp16 d, 32 int8. Value d * q."""
    b = _blocks(data, 34)
    n = b.shape[0]
    out = _out(out, n * 32)
    o, q = out.reshape(n, 32), b[:, 2:].view(np.int8)
    for i, j in _chunks(n, 32):
        _finish(o[i:j], q[i:j], _f16(b[i:j], 0)[:, None])
    return out


def q4_0(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of 32: fp16 d, 16 bytes; low nibbles are values 0-15, high nibbles 16-31. Value d * (q - 8)."""
    b = _blocks(data, 18)
    n = b.shape[0]
    out = _out(out, n * 32)
    o = out.reshape(n, 2, 16)
    lh = np.empty((2, max(1, CHUNK // 32), 18), dtype=np.uint8)
    for i, j in _chunks(n, 32):
        k = j - i
        np.bitwise_and(b[i:j], 15, out=lh[0, :k])
        np.right_shift(b[i:j], 4, out=lh[1, :k])
        lh[:, :k] -= 8  # wraps around: q - 8 as int8
        _finish(o[i:j], lh[:, :k, 2:].transpose(1, 0, 2).view(np.int8), _f16(b[i:j], 0)[:, None])
    return out


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K blocks -> (blocks, 8) scales d*sc and minimums dmin*m. The 12 scale bytes s0|s1|s2 (4 each)
    hold six-bit sc 0-3 in s0 & 63, m 0-3 in s1 & 63, sc 4-7 in (s2 & 15) | (s0 >> 6) << 4, m 4-7 in
    (s2 >> 4) | (s1 >> 6) << 4: worked on four bytes at a time as uint32."""
    k = b.shape[0]
    w = b.view(np.uint32)
    s0, s1, s2 = w[:, 1], w[:, 2], w[:, 3]
    six = np.empty((k, 4), dtype=np.uint32)  # as bytes: sc 0-7, m 0-7
    np.bitwise_and(s0, 0x3F3F3F3F, out=six[:, 0])
    np.bitwise_or(s2 & 0x0F0F0F0F, (s0 >> 2) & 0x30303030, out=six[:, 1])
    np.bitwise_and(s1, 0x3F3F3F3F, out=six[:, 2])
    np.bitwise_or((s2 >> 4) & 0x0F0F0F0F, (s1 >> 2) & 0x30303030, out=six[:, 3])
    dm = np.ascontiguousarray(w[:, 0]).view(np.float16).astype(F32)  # d, dmin of each block
    sm = np.multiply(six.view(np.uint8), np.repeat(dm, 8).reshape(k, 16), dtype=F32)
    return sm[:, :8], sm[:, 8:]


def q4_k(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of 256: fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of 4-bit values (per 32 bytes: low
    nibbles are one sub-block of 32, high nibbles the next). Value (d sc) q - (dmin m)."""
    b = _blocks(data, 144)
    n = b.shape[0]
    out = _out(out, n * 256)
    o = out.reshape(n, 4, 2, 32)
    lh = np.empty((2, max(1, CHUNK // 256), 18), dtype=np.uint64)
    for i, j in _chunks(n, 256):
        q = _nibbles(b[i:j].view(np.uint64), lh)[:, :, 16:].reshape(2, j - i, 4, 32).transpose(1, 2, 0, 3)
        _finish(o[i:j], q, *_k_scales(b[i:j]))
    return out


_SHIFT1 = np.arange(8, dtype=np.uint64)[:, None, None]


def q5_k(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q4_K plus 32 bytes of fifth bits (bit i of byte j: value j of sub-block i), before the values."""
    b = _blocks(data, 176)
    n = b.shape[0]
    out = _out(out, n * 256)
    o = out.reshape(n, 4, 2, 32)
    step = max(1, CHUNK // 256)
    lh, hb = np.empty((2, step, 22), dtype=np.uint64), np.empty((8, step, 4), dtype=np.uint64)
    q = np.empty((step, 4, 2, 32), dtype=np.uint8)
    for i, j in _chunks(n, 256):
        k, r = j - i, b[i:j].view(np.uint64)
        nib = _nibbles(r, lh)[:, :, 48:].reshape(2, k, 4, 32).transpose(1, 2, 0, 3)
        h = hb[:, :k]  # (sub-block i, block, 4 words): bit i of each fifth-bits byte, at bit 4
        np.right_shift(np.ascontiguousarray(r[:, 2:6]), _SHIFT1, out=h)
        h &= np.uint64(0x0101010101010101)
        h <<= 4
        np.bitwise_or(nib, h.view(np.uint8).transpose(1, 0, 2).reshape(k, 4, 2, 32), out=q[:k])
        _finish(o[i:j], q[:k], *_k_scales(b[i:j]))
    return out


_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint64)[:, None, None]


def q6_k(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of 256: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales, fp16 d.
    Per half (128 values): ql[0:32] low/high nibbles are values 0-31 / 64-95, ql[32:64] 32-63 /
    96-127; qh byte j holds the high bits of values j, j+32, j+64, j+96. Value (d sc) (q - 32)."""
    b = _blocks(data, 210)
    n = b.shape[0]
    out = _out(out, n * 256)
    o = out.reshape(n, 16, 16)
    step = max(1, CHUNK // 256)
    lh, hb = np.empty((2, step, 16), dtype=np.uint64), np.empty((4, step, 8), dtype=np.uint64)
    q = np.empty((step, 2, 2, 2, 32), dtype=np.uint8)  # (block, half, nibble, 32-byte run, 32)
    for i, j in _chunks(n, 256):
        k, c = j - i, b[i:j]
        nib = _nibbles(np.ascontiguousarray(c[:, :128]).view(np.uint64), lh)
        h = hb[:, :k]  # (quarter, block, 8 words): the quarter's two high bits of each value, at bits 4-5
        np.right_shift(np.ascontiguousarray(c[:, 128:192]).view(np.uint64), _SHIFT2, out=h)
        h &= np.uint64(0x0303030303030303)
        h <<= 4
        h8 = h.view(np.uint8)
        h8 -= 32  # wraps around: once the low nibble is or-ed in, q - 32 as int8
        np.bitwise_or(nib.reshape(2, k, 2, 2, 32).transpose(1, 2, 0, 3, 4),
                      h8.reshape(4, k, 2, 32).transpose(1, 2, 0, 3).reshape(k, 2, 2, 2, 32), out=q[:k])
        scale = np.multiply(c[:, 192:208].view(np.int8), _f16(c, 104)[:, None], dtype=F32)
        _finish(o[i:j], q[:k].view(np.int8).reshape(k, 16, 16), scale)
    return out


_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=F32)
_IQ4_PAIRS = np.stack([_IQ4NL[np.arange(256) & 15], _IQ4NL[np.arange(256) >> 4]], axis=1).view(np.uint64)[:, 0]


def iq4_xs(data: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of 256: fp16 d, 2 bytes scales_h, 4 bytes scales_l, 128 bytes of 4-bit indices into the 16
    kvalues of IQ4_NL (per sub-block of 32, 16 bytes: low nibbles are values 0-15, high nibbles 16-31).
    Sub-block i's six-bit scale: nibble i of scales_l, bits 2i-2i+1 of scales_h above it. Value
    d (ls - 32) kvalue[q]; each byte looks both its kvalues up at once in a 256-entry table of pairs."""
    b = _blocks(data, 136)
    n = b.shape[0]
    out = _out(out, n * 256)
    o = out.reshape(n, 8, 2, 16)
    g = np.empty((max(1, CHUNK // 256), 128), dtype=np.uint64)
    sub = np.arange(8, dtype=np.uint32)[:, None]
    for i, j in _chunks(n, 256):
        k, c = j - i, b[i:j]
        ls = ((c.view(np.uint32)[:, 1] >> 4 * sub) & 15) | ((c.view(np.uint16)[:, 1] >> 2 * sub) & 3) << 4
        dl = np.multiply(ls.T.astype(np.int8) - np.int8(32), _f16(c, 0)[:, None], dtype=F32)  # (k, 8)
        np.take(_IQ4_PAIRS, c[:, 8:], out=g[:k], mode="wrap")
        _finish(o[i:j], g[:k].view(F32).reshape(k, 8, 16, 2).transpose(0, 1, 3, 2), dl)
    return out


FAST = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ4_XS": iq4_xs}  # by name
