"""Dequantizers for the quant types most GGUFs keep their large matrices in (Q8_0, and the K-quants of
the common "Q4_K_M"-style mixes): the same float32 values as gguf-py's, computed in the same order,
3-4x faster. Routed experts of MoE models are dequantized on every expert-cache miss, so this speed is
decode speed there. Other types go to gguf.quants.dequantize (gguf.py).

Each function takes the raw bytes of whole blocks (any shape whose size is a multiple of the block
size) and returns a flat float32 array; QK_K = 256 values per K-quant block.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def _fp16(b: np.ndarray) -> np.ndarray:
    """(blocks, 2) bytes -> (blocks, 1) float32."""
    return b.copy().view(np.float16).astype(F32)


def q8_0(data: np.ndarray) -> np.ndarray:
    """Blocks of 32: fp16 d, 32 int8. Value d * q."""
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 34)
    out = np.empty((blocks.shape[0], 32), dtype=F32)
    np.multiply(blocks[:, 2:].view(np.int8), _fp16(blocks[:, :2]), out=out)
    return out.reshape(-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit minimums per block."""
    s0, s1, s2 = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([s0 & 63, (s2 & 15) | ((s0 >> 6) << 4)], axis=1)  # (blocks, 8)
    mn = np.concatenate([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], axis=1)
    return sc, mn


def q4_k(data: np.ndarray) -> np.ndarray:
    """Blocks of 256: fp16 d, fp16 dmin, 12 scale bytes, 128 bytes of 4-bit values (per 32 bytes:
    low nibbles are one sub-block of 32, high nibbles the next). Value (d sc) q - (dmin m)."""
    b = np.asarray(data, dtype=np.uint8).reshape(-1, 144)
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    scale = _fp16(b[:, 0:2]) * sc.astype(F32)  # (n, 8)
    minimum = _fp16(b[:, 2:4]) * mn.astype(F32)
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    out = np.empty((n, 4, 2, 32), dtype=F32)
    np.bitwise_and(qs[:, :, 0], 15, out=out[:, :, 0], casting="unsafe")
    np.right_shift(qs[:, :, 0], 4, out=out[:, :, 1], casting="unsafe")
    out = out.reshape(n, 8, 32)
    out *= scale[:, :, None]
    out -= minimum[:, :, None]
    return out.reshape(-1)


def q5_k(data: np.ndarray) -> np.ndarray:
    """Q4_K plus 32 bytes of fifth bits (bit i of byte j: value j of sub-block i), before the values."""
    b = np.asarray(data, dtype=np.uint8).reshape(-1, 176)
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    scale = _fp16(b[:, 0:2]) * sc.astype(F32)  # (n, 8)
    minimum = _fp16(b[:, 2:4]) * mn.astype(F32)
    qh = b[:, 16:48]  # (n, 32)
    qs = b[:, 48:].reshape(n, 4, 32)
    q = np.empty((n, 4, 2, 32), dtype=np.uint8)
    np.bitwise_and(qs, 15, out=q[:, :, 0])
    np.right_shift(qs, 4, out=q[:, :, 1])
    q = q.reshape(n, 8, 32)
    q |= ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    out = q.astype(F32)
    out *= scale[:, :, None]
    out -= minimum[:, :, None]
    return out.reshape(-1)


def q6_k(data: np.ndarray) -> np.ndarray:
    """Blocks of 256: 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales, fp16 d.
    Per half (128 values): ql[0:32] low/high nibbles are values 0-31 / 64-95, ql[32:64] 32-63 /
    96-127; qh byte j holds the high bits of values j, j+32, j+64, j+96. Value (d sc) (q - 32)."""
    b = np.asarray(data, dtype=np.uint8).reshape(-1, 210)
    n = b.shape[0]
    scale = _fp16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(F32)  # (n, 16): one per 16 values
    ql = b[:, 0:128].reshape(n, 2, 1, 64)  # (n, half, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    q = np.empty((n, 2, 2, 64), dtype=np.uint8)  # (n, half, nibble, 64): values 0-63, then 64-127
    np.bitwise_and(ql[:, :, 0], 15, out=q[:, :, 0])
    np.right_shift(ql[:, :, 0], 4, out=q[:, :, 1])
    q = q.reshape(n, 2, 4, 32)  # (n, half, quarter, 32)
    q |= ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3) << 4
    out = q.view(np.int8).astype(F32)
    out -= 32
    out = out.reshape(n, 16, 16)
    out *= scale[:, :, None]
    return out.reshape(-1)


FAST = {"Q8_0": q8_0, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}  # by GGMLQuantizationType name
