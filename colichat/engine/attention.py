"""Attention over the cache: GQA (llama) and MLA (deepseek2, absorbed and decompressed forms).
Axis letters: engine/__init__.py (tb below: the queries of one block, m: the keys it sees)."""

from __future__ import annotations

import numpy as np

from .gguf import kernels
from .ops import KERNEL_WORKERS, SMALL_BATCH, WORKERS, causal_mask, run_blocks, softmax

SCORE_BUDGET = 1 << 25  # floats in one (rows, N) score block: bounds attention scratch to ~128 MiB
QUERY_BLOCK = 128  # prefill queries per block: later keys of a block are left out (causal)
DECOMPRESS_BUDGET = 1 << 26  # floats of decompressed per-head keys+values the naive MLA form may make


def _query_blocks(t: int, h: int, n: int):
    """[i0, i1) query ranges: at most QUERY_BLOCK queries and SCORE_BUDGET scores (H * rows * N) each."""
    tb = max(1, min(t, QUERY_BLOCK, SCORE_BUDGET // max(1, h * n)))
    return [(i0, min(t, i0 + tb)) for i0 in range(0, t, tb)]


def _exp_rows(s: np.ndarray) -> np.ndarray:
    """In place: s <- exp(s - rowmax); returns the row sums (keepdims), to divide the output by."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    return s.sum(axis=-1, keepdims=True)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float,
                  compiled: bool = False) -> np.ndarray:
    """Grouped-query attention; query head h uses KV head h // J (ggml broadcast, HF repeat_kv).

    q: (T, H, E) roped queries at positions pos0..pos0+T-1;
    k, v: (N, G, E) cache views (rows 0..N-1, N = pos0 + T, new rows already written).
    compiled: a pass of 1..SMALL_BATCH queries (decode, verify) takes the compiled kernel (the kernel path:
    gguf/kernel_attention.py, in its own fixed order, E a multiple of 8); else numpy's (the reference).
    Returns (T, H * E).
    """
    t, h, e = q.shape
    n, g, _ = k.shape
    qpk = h // g
    if compiled and t <= SMALL_BATCH and e % 8 == 0:
        workers = KERNEL_WORKERS.get()  # (the small pass's threads share its parts of the cache rows)
        return kernels.gqa_rows(q, k.reshape(n, g * e), v.reshape(n, g * e), pos0, scale,
                                lambda compute, parts: run_blocks(compute, lambda i, _: None, parts, workers))
    if 1 < t <= SMALL_BATCH:  # one query at a time, exactly as decoding computes it (ops.linear)
        return np.concatenate([gqa_attention(q[i : i + 1], k[: pos0 + i + 1], v[: pos0 + i + 1], pos0 + i, scale)
                               for i in range(t)])
    if t > 1:
        return _gqa_prefill(q, k, v, pos0, scale)
    qg = q.reshape(g, qpk, e)  # (G, J, E): one query
    s = np.matmul(qg, k.transpose(1, 2, 0))  # (G, J, N)
    s *= np.float32(scale)
    softmax(s)
    o = np.matmul(s, v.transpose(1, 0, 2))  # (G, J, E)
    return o.reshape(1, h * e)


def _gqa_prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """gqa_attention for more than SMALL_BATCH queries: per KV head and block of queries (_query_blocks), its
    J query heads' scores against the keys the block sees (causal: later keys left out, the mask only on the
    block's last ones), shared by the pass's WORKERS. Each (head, block) is the same BLAS calls whoever
    computes it: the bits depend on the shape alone."""
    t, h, e = q.shape
    n, g, _ = k.shape
    qpk = h // g
    out = np.empty((t, g, qpk, e), dtype=np.float32)  # (T, G, J, E)
    tasks = [(i, i0, i1) for i in range(g) for i0, i1 in _query_blocks(t, qpk, n)]

    def task(j: int) -> None:
        i, i0, i1 = tasks[j]
        tb, m, first = i1 - i0, pos0 + i1, pos0 + i0  # keys 0 .. m - 1; a mask from key first + 1 on
        qb = q[i0:i1, i * qpk : (i + 1) * qpk].transpose(1, 0, 2).reshape(qpk * tb, e)  # (J*tb, E)
        s = qb @ k[:m, i].T  # (J*tb, m)
        s *= np.float32(scale)
        s.reshape(qpk, tb, m)[:, :, first:] += causal_mask(first, tb, m)[:, first:]
        s /= _exp_rows(s)  # (J*tb, m) probabilities: a prompt of up to QUERY_BLOCK tokens gets softmax's bits
        out[i0:i1, i] = (s @ v[:m, i]).reshape(qpk, tb, e).transpose(1, 0, 2)

    run_blocks(task, lambda j, _: None, len(tasks), WORKERS.get())
    return out.reshape(t, h * e)


def mla_absorbed(
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    kv: np.ndarray,
    k_b: np.ndarray,
    v_b: np.ndarray,
    pos0: int,
    scale: float,
    q_scale: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """MLA in the absorbed form (mla-spec 5.4): one shared 'MQA' key [c | k_pe] per cached token.

    q_nope: (T, H, Dn); q_pe: (T, H, R) roped, for positions pos0..pos0+T-1;
    kv: (N, C+R) cache rows [c | k_pe] (a strided view is fine), N = pos0 + T, new rows written;
    k_b: (H, C, Dn) (attn_k_b); v_b: (H, Dv, C) (attn_v_b); scale: kq_scale (uses d_qk, not C+R);
    q_scale: optional (T,) query temperature; mask: optional (T, N) additive float32 mask used
    instead of the causal one (0 kept, -inf dropped): the keys sparse attention selected, which
    never include later positions.
    Returns (T, H * Dv).
    """
    if 1 < q_nope.shape[0] <= SMALL_BATCH:  # one query at a time, exactly as decoding computes it (ops.linear)
        return _mla_per_query(mla_absorbed, q_nope, q_pe, kv, k_b, v_b, pos0, scale, q_scale, mask)
    t, h, _ = q_nope.shape
    n, cr = kv.shape
    c = k_b.shape[1]
    qh = np.empty((t, h, cr), dtype=np.float32)  # (T, H, C+R) absorbed queries [K_b q_nope | q_pe]
    # per head: q~ = K_b[h] @ q_nope[h], batched over heads: (H, T, Dn) @ (H, Dn, C) -> (H, T, C)
    qh[:, :, :c] = np.matmul(q_nope.transpose(1, 0, 2), k_b.transpose(0, 2, 1)).transpose(1, 0, 2)
    qh[:, :, c:] = q_pe
    if q_scale is not None:
        qh *= q_scale[:, None, None]
    qh *= np.float32(scale)
    lat = np.empty((t, h, c), dtype=np.float32)  # (T, H, C) attention-weighted latents
    for i0, i1 in _query_blocks(t, h, n):
        m = pos0 + i1  # keys past the block's last query are masked anyway: leave them out
        s = qh[i0:i1].reshape((i1 - i0) * h, cr) @ kv[:m].T  # (tb*H, m)
        if t > 1 or mask is not None:
            s3 = s.reshape(i1 - i0, h, m)
            s3 += (causal_mask(pos0 + i0, i1 - i0, m) if mask is None else mask[i0:i1, :m])[:, None, :]
        z = _exp_rows(s)  # (tb*H, 1) row sums; s now holds unnormalized probabilities
        lat[i0:i1] = ((s @ kv[:m, :c]) / z).reshape(i1 - i0, h, c)  # (tb, H, C)
    o = np.matmul(lat.transpose(1, 0, 2), v_b.transpose(0, 2, 1))  # (H, T, Dv)
    return o.transpose(1, 0, 2).reshape(t, -1)  # (T, H*Dv)


def mla_naive(
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    kv: np.ndarray,
    k_b: np.ndarray,
    v_b: np.ndarray,
    pos0: int,
    scale: float,
    q_scale: np.ndarray | None = None,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """MLA in the decompressed multi-head form (mla-spec 5.3): every cached latent is expanded to
    per-head k_nope = W_UK c and v = W_UV c. Same arguments and result as mla_absorbed; cheaper
    than it for long query chunks (see prefer_naive), much dearer for decode."""
    if 1 < q_nope.shape[0] <= SMALL_BATCH:  # one query at a time, exactly as decoding computes it (ops.linear)
        return _mla_per_query(mla_naive, q_nope, q_pe, kv, k_b, v_b, pos0, scale, q_scale, mask)
    t, h, _ = q_nope.shape
    n, cr = kv.shape
    c = k_b.shape[1]
    lat = kv[:, :c]  # (N, C)
    k = np.matmul(lat, k_b)  # (H, N, Dn): per head c @ K_b[h] = (W_UK c)^T
    v = np.matmul(lat, v_b.transpose(0, 2, 1))  # (H, N, Dv)
    sc = np.float32(scale) if q_scale is None else (np.float32(scale) * q_scale)[None, :, None]
    qn = q_nope.transpose(1, 0, 2) * sc  # (H, T, Dn), scale folded in
    qr = q_pe.transpose(1, 0, 2) * sc  # (H, T, R)
    out = np.empty((h, t, v.shape[2]), dtype=np.float32)  # (H, T, Dv)
    for i0, i1 in _query_blocks(t, h, n):
        m = pos0 + i1  # keys past the block's last query are masked anyway: leave them out
        s = np.matmul(qn[:, i0:i1], k[:, :m].transpose(0, 2, 1))  # (H, tb, m)
        s += (qr[:, i0:i1].reshape(-1, cr - c) @ kv[:m, c:].T).reshape(h, i1 - i0, m)  # rope part
        if t > 1 or mask is not None:
            s += causal_mask(pos0 + i0, i1 - i0, m) if mask is None else mask[i0:i1, :m]
        z = _exp_rows(s)  # (H, tb, 1)
        out[:, i0:i1] = np.matmul(s, v[:, :m]) / z  # (H, tb, Dv)
    return out.transpose(1, 0, 2).reshape(t, -1)  # (T, H*Dv)


def _mla_per_query(form, q_nope, q_pe, kv, k_b, v_b, pos0: int, scale: float, q_scale, mask) -> np.ndarray:
    """The MLA form run for each query alone over the keys it sees: (T, H * Dv)."""
    return np.concatenate([
        form(q_nope[i : i + 1], q_pe[i : i + 1], kv[: pos0 + i + 1], k_b, v_b, pos0 + i, scale,
             None if q_scale is None else q_scale[i : i + 1], None if mask is None else mask[i : i + 1, : pos0 + i + 1])
        for i in range(q_nope.shape[0])
    ])


def prefer_naive(t: int, n: int, h: int, c: int, dn: int, dv: int) -> bool:
    """Whether the decompressed form is cheaper for T queries over N keys.

    Per (query, key, head) the absorbed form costs 2C + R multiply-adds, the naive one Dn + R + Dv
    plus C (Dn + Dv) per key and head to decompress. Measured on one DeepSeek-V2-Lite layer (H 16,
    C 512, Dn = Dv = 128): naive is faster from T ~ 200 on (1.5x at T = 512) and far slower for
    decode; the 1.3 margin puts the switch there. The decompressed keys and values must also fit
    DECOMPRESS_BUDGET (large-H models with long contexts stay absorbed).
    """
    per_pair = 2 * c - dn - dv
    return per_pair > 0 and t * per_pair > 1.3 * c * (dn + dv) and h * n * (dn + dv) <= DECOMPRESS_BUDGET
