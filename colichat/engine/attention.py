"""Attention over the cache. Axis letters: T new tokens, N cached tokens (including the new ones),
H query heads, G KV heads (GQA), Q = H / G queries per KV head, E head size.
"""

from __future__ import annotations

import numpy as np

from .ops import causal_mask, softmax


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """Grouped-query attention; query head h uses KV head h // Q (ggml broadcast, HF repeat_kv).

    q: (T, H, E) roped queries at positions pos0..pos0+T-1;
    k, v: (N, G, E) cache views (rows 0..N-1, N = pos0 + T, new rows already written).
    Returns (T, H * E).
    """
    t, h, e = q.shape
    n, g, _ = k.shape
    qpk = h // g
    qg = q.reshape(t, g, qpk, e).transpose(1, 2, 0, 3).reshape(g, qpk * t, e)  # (G, Q*T, E)
    s = np.matmul(qg, k.transpose(1, 2, 0))  # (G, Q*T, N)
    s *= np.float32(scale)
    if t > 1:
        s = s.reshape(g, qpk, t, n)
        s += causal_mask(pos0, t, n)  # (T, N) broadcast
        s = s.reshape(g, qpk * t, n)
    softmax(s)
    o = np.matmul(s, v.transpose(1, 0, 2))  # (G, Q*T, E)
    o = o.reshape(g, qpk, t, e).transpose(2, 0, 1, 3)  # (T, G, Q, E)
    return o.reshape(t, h * e)
