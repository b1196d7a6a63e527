"""Small array functions shared by the attention and FFN code (all float32, last axis)."""

from __future__ import annotations

import numpy as np

SMALL_BATCH = 16  # up to this many tokens, a pass computes every row exactly as a one-token pass would
MATVEC_BLOCK = 256 << 10  # bytes of a weight block kept in L2 while every row of a small batch reads it


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T: x (T, Z), w (O, Z) -> (T, O).

    For 2 <= T <= SMALL_BATCH, row i is bit for bit linear(x[i:i+1], w) (a matrix-vector product),
    so a verify pass of speculative decoding writes the same cache rows and logits as decoding its
    tokens one by one. The weights still stream from memory once: each block of MATVEC_BLOCK bytes
    serves all T rows from the CPU cache (a matrix-vector product per row and block; BLAS computes
    each output of one from its weight row and x alone). OpenBLAS's small-T matrix product is both
    slower here (it repacks the weights) and rounds differently.
    """
    t = x.shape[0]
    if t == 1 or t > SMALL_BATCH:
        return x @ w.T
    o, z = w.shape
    blk = max(8, MATVEC_BLOCK // (4 * z) // 8 * 8)  # weight rows (outputs) per block
    nb = o // blk
    out = np.empty((t, o), dtype=np.result_type(x, w))  # (T, O)
    xc = np.ascontiguousarray(x)[None, :, :, None]  # (1, T, Z, 1): a column per row
    if nb:
        wb = w[: nb * blk].reshape(nb, 1, blk, z)  # (blocks, 1, blk, Z)
        out[:, : nb * blk] = np.matmul(wb, xc)[..., 0].transpose(1, 0, 2).reshape(t, nb * blk)  # (blocks, T, blk)
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
