"""The lightning indexer of sparse-attention MLA (DSA: deepseek32, glm-dsa), as pure array functions.

docs/dsa-mtp-spec.md has the math. Per new token at position p, a full-indexer layer computes one
indexer key k_I (LayerNorm'd, RoPE'd; the cache keeps it, the Ic row of the record), Hi indexer
queries q_I and Hi head weights w; the score of every cached position s <= p is
    score(p, s) = sum_h w_h relu(q_I[h] . k_I(s)),
and the layer's MLA attention for query p uses only the K best-scoring positions (all causal ones
while p + 1 <= K). Ties are broken by the lower position.

Layout of q_I heads and k_I: "rope | nope": RoPE on the first R = qk_rope dims, the rest untouched.
Pairing: NEOX (x[i], x[i + R/2]) for deepseek32, NORM (x[2i], x[2i+1]) for glm-dsa, with the same
angles as the main rope (`rot`, complex64 (T, R/2) for the tokens' positions).

llama.cpp also multiplies q_I and k_I by an orthonormal Hadamard matrix before the dot product;
that changes no score beyond rounding, so colichat keeps k_I un-rotated.

Axis letters: T new tokens, N cached tokens (including the new ones), Hi indexer heads, Di indexer
head size, R rotated dims, Q q latent (q_lora_rank), D model width.
"""

from __future__ import annotations

import numpy as np

from .ops import linear

SCORE_BUDGET = 1 << 24  # floats of one (rows * Hi, N) block of per-head products


def rope_prefix(x: np.ndarray, rot: np.ndarray, neox: bool) -> np.ndarray:
    """RoPE on the first 2I dims of the last axis (I = rot.shape[1]); the rest is copied.

    x: (T, ..., Di) for positions of rot (T, I) complex64. NEOX pairs (i, i + I), NORM (2i, 2i+1).
    """
    t, i2 = x.shape[0], 2 * rot.shape[1]
    out = np.array(x, dtype=np.float32)  # (T, ..., Di) copy
    shape = (t,) + (1,) * (x.ndim - 2) + (rot.shape[1],)
    cos, sin = rot.real.reshape(shape), rot.imag.reshape(shape)  # (T, 1.., I)
    if neox:
        a, b = x[..., : i2 // 2], x[..., i2 // 2 : i2]
    else:
        a, b = x[..., 0:i2:2], x[..., 1:i2:2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if neox:
        out[..., : i2 // 2], out[..., i2 // 2 : i2] = ra, rb
    else:
        out[..., 0:i2:2], out[..., 1:i2:2] = ra, rb
    return out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (statistics in float64)."""
    x64 = x.astype(np.float64)
    mu = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mu) ** 2).mean(axis=-1, keepdims=True)
    out = ((x64 - mu) / np.sqrt(var + eps)).astype(np.float32)
    out *= weight
    out += bias
    return out


def indexer_keys(x: np.ndarray, attn_k: np.ndarray, k_norm: np.ndarray, k_norm_b: np.ndarray,
                 eps: float, rot: np.ndarray, neox: bool) -> np.ndarray:
    """The Ic rows of new tokens: RoPE(LayerNorm(attn_k x)). x: (T, D) attn_norm output;
    attn_k: (Di, D). Returns (T, Di)."""
    k = layer_norm(linear(x, attn_k), k_norm, k_norm_b, eps)  # (T, Di)
    return rope_prefix(k, rot, neox)


def indexer_queries(qr: np.ndarray, attn_q_b: np.ndarray, n_head: int, rot: np.ndarray,
                    neox: bool) -> np.ndarray:
    """q_I per head: qr (T, Q) normed q latent, attn_q_b (Hi*Di, Q). Returns (T, Hi, Di)."""
    t = qr.shape[0]
    q = linear(qr, attn_q_b).reshape(t, n_head, -1)  # (T, Hi, Di)
    return rope_prefix(q, rot, neox)


def indexer_head_weights(x: np.ndarray, proj: np.ndarray, head_dim: int) -> np.ndarray:
    """w = (proj x) / sqrt(Di * Hi): x (T, D) attn_norm output, proj (Hi, D). Returns (T, Hi)."""
    w = linear(x, proj)  # (T, Hi)
    w *= np.float32(1.0 / np.sqrt(head_dim * proj.shape[0]))
    return w


def indexer_scores(q: np.ndarray, w: np.ndarray, keys: np.ndarray, pos0: int) -> np.ndarray:
    """score(p, s) = sum_h w[p, h] relu(q[p, h] . keys[s]) for s <= p, -inf for s > p.

    q: (T, Hi, Di) queries at positions pos0..pos0+T-1; w: (T, Hi) scaled head weights;
    keys: (N, Di) cached Ic rows 0..N-1 (N = pos0 + T; a strided view is fine). Returns (T, N)
    float32. Cost per query: Hi * Di * N multiply-adds (linear in the context)."""
    t, hi, di = q.shape
    n = keys.shape[0]
    out = np.empty((t, n), dtype=np.float32)  # (T, N)
    kt = np.ascontiguousarray(keys.T)  # (Di, N)
    tb = max(1, min(t, SCORE_BUDGET // max(1, hi * n)))
    for i0 in range(0, t, tb):
        i1 = min(t, i0 + tb)
        m = pos0 + i1  # later keys are masked anyway
        s = q[i0:i1].reshape(-1, di) @ kt[:, :m]  # (tb*Hi, m) per-head products
        np.maximum(s, 0.0, out=s)  # relu
        # weighted sum over heads: (tb, 1, Hi) @ (tb, Hi, m) -> (tb, 1, m)
        out[i0:i1, :m] = np.matmul(w[i0:i1, None, :], s.reshape(i1 - i0, hi, m))[:, 0]
        out[i0:i1, m:] = -np.inf
    if t > 1:
        qpos = np.arange(pos0, pos0 + t)[:, None]
        out[np.arange(n)[None, :] > qpos] = -np.inf
    return out


def top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """(T, N) bool: per row the k largest finite scores, ties broken by the lower position; every
    finite one when a row has at most k. Linear in N (np.partition, no sort)."""
    t, n = scores.shape
    finite = np.isfinite(scores)
    if k >= n:
        return finite
    kth = np.partition(scores, n - k, axis=1)[:, n - k : n - k + 1]  # (T, 1) k-th largest
    keep = scores > kth  # strictly better: all kept (fewer than k)
    tied = scores == kth  # (T, N) fill the remaining places with the lowest tied positions
    need = k - keep.sum(axis=1, keepdims=True)  # (T, 1)
    keep |= tied & (np.cumsum(tied, axis=1) <= need)
    keep &= finite  # rows with fewer than k causal keys: -inf is never selected
    return keep


def top_k_positions(scores: np.ndarray, k: int) -> np.ndarray:
    """One row of scores (N,) -> the selected positions in increasing order (decode)."""
    return np.flatnonzero(top_k_mask(scores[None, :], k)[0])


def selection_mask(keep: np.ndarray) -> np.ndarray:
    """(T, N) bool selection -> the additive float32 mask of attention: 0 kept, -inf dropped."""
    return np.where(keep, np.float32(0.0), np.float32(-np.inf))
