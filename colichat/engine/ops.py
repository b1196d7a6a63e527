"""Small array functions shared by the attention and FFN code (all float32, last axis)."""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (the mean accumulated in float64)."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return (x * (1.0 / np.sqrt(ms + eps)).astype(np.float32)) * weight


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """In place when possible: x is a scratch array of scores."""
    x -= np.max(x, axis=axis, keepdims=True)
    np.exp(x, out=x)
    x /= np.sum(x, axis=axis, keepdims=True)
    return x


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def causal_mask(pos0: int, t: int, n: int) -> np.ndarray:
    """(T, N) additive mask: query i (position pos0+i) sees keys 0..pos0+i."""
    q = np.arange(pos0, pos0 + t)[:, None]
    k = np.arange(n)[None, :]
    return np.where(k <= q, np.float32(0.0), np.float32(-np.inf))
