"""Small array functions shared by the attention and FFN code (all float32, last axis)."""

from __future__ import annotations

import numpy as np


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
