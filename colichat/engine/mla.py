"""deepseek2's attention block, shared by every MLA architecture (deepseek2, plm, minicpm3).

    prepare_mla_attention(cfg, get, b, w)   # the layer's attention weights into w (legacy attn_kv_b split)
    mla_attention(cfg, w, b, u, pos0, cache, l, rope, kq_scale) -> (T, D)   # attention output, pre-residual

Axis letters: T new tokens, D model width, H heads, Q q_lora_rank, C kv_lora_rank, R qk_rope,
Dn qk_nope, K = Dn + R (q head), Dv v head, N cached tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .attention import mla_absorbed, mla_naive, prefer_naive
from .cache import KVCache
from .gguf import ModelConfig
from .ops import rms_norm


def prepare_mla_attention(cfg: ModelConfig, get: Callable, b: str, w: dict) -> None:
    """Layer b's attention weights, dequantized into w: q_a|kv_a_mqa (or q|kv_a_mqa) fused into
    attn_in, legacy attn_kv_b split into attn_k_b/attn_v_b; the norms and attn_output.
    get(name, shape) returns the f32 tensor after checking its shape."""
    d, h, c, r = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim
    dn, dv, k, rq = cfg.qk_nope, cfg.v_head_dim, cfg.qk_head, cfg.q_lora_rank
    w[b + "attn_norm"] = get(b + "attn_norm.weight", (d,))
    kv_a = get(b + "attn_kv_a_mqa.weight", (c + r, d))  # (C+R, D)
    if rq:
        q_in = get(b + "attn_q_a.weight", (rq, d))  # (Q, D)
        w[b + "attn_q_a_norm"] = get(b + "attn_q_a_norm.weight", (rq,))
        w[b + "attn_q_b"] = get(b + "attn_q_b.weight", (h * k, rq))  # (H*K, Q)
    else:
        q_in = get(b + "attn_q.weight", (h * k, d))  # (H*K, D)
    w[b + "attn_in"] = np.concatenate([q_in, kv_a])  # (Q+C+R, D) or (H*K+C+R, D): one matmul
    del q_in, kv_a
    w[b + "attn_kv_a_norm"] = get(b + "attn_kv_a_norm.weight", (c,))
    if cfg.mla_split:
        w[b + "attn_k_b"] = get(b + "attn_k_b.weight", (h, c, dn))  # (H, C, Dn)
        w[b + "attn_v_b"] = get(b + "attn_v_b.weight", (h, dv, c))  # (H, Dv, C)
    else:  # legacy: per head [W_UK (Dn rows); W_UV (Dv rows)] (mla-spec 3.2)
        w3 = get(b + "attn_kv_b.weight", (h * (dn + dv), c)).reshape(h, dn + dv, c)
        w[b + "attn_k_b"] = np.ascontiguousarray(w3[:, :dn].transpose(0, 2, 1))  # (H, C, Dn)
        w[b + "attn_v_b"] = np.ascontiguousarray(w3[:, dn:])  # (H, Dv, C)
    w[b + "attn_output"] = get(b + "attn_output.weight", (d, h * dv))  # (D, H*Dv)


def mla_attention(cfg: ModelConfig, w: dict, b: str, u: np.ndarray, pos0: int, cache: KVCache, l: int,
                  rope: Callable[[np.ndarray, int], np.ndarray], kq_scale: float,
                  q_scale: np.ndarray | None = None) -> np.ndarray:
    """MLA over the latent cache (mla-spec 5.2-5.4): writes layer l's rows pos0..pos0+T-1 (c, then
    the roped k_pe) and returns the attention output W_O o, (T, D). u: the normed input (T, D);
    rope(x, pos0): x (T, ..., R) rotated for positions pos0..; q_scale: optional (T,) query
    temperature. Decode and short chunks use the absorbed form, long prefill chunks the
    decompressed one (faster there)."""
    t, h, c, dn, k = u.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_head
    z = u @ w[b + "attn_in"].T  # (T, Q+C+R) or (T, H*K+C+R)
    nq = z.shape[1] - c - cfg.rope_dim
    if cfg.q_lora_rank:
        q = rms_norm(z[:, :nq], w[b + "attn_q_a_norm"], cfg.rms_eps) @ w[b + "attn_q_b"].T  # (T, H*K)
    else:
        q = z[:, :nq]  # (T, H*K)
    q = q.reshape(t, h, k)  # (T, H, K): per head [nope (Dn) | rope (R)]
    q_pe = rope(q[:, :, dn:], pos0)  # (T, H, R)
    n = pos0 + t
    cache.a[l][pos0:n] = rms_norm(z[:, nq : nq + c], w[b + "attn_kv_a_norm"], cfg.rms_eps)  # c (T, C)
    cache.b[l][pos0:n] = rope(z[:, nq + c :], pos0)  # k_pe (T, R)
    kv = cache.records["kv"][:n, l]  # (N, C+R) view of the cache rows [c | k_pe]
    k_b, v_b = w[b + "attn_k_b"], w[b + "attn_v_b"]  # (H, C, Dn), (H, Dv, C)
    form = mla_naive if prefer_naive(t, n, h, c, dn, cfg.v_head_dim) else mla_absorbed
    o = form(q[:, :, :dn], q_pe, kv, k_b, v_b, pos0, kq_scale, q_scale)  # (T, H*Dv)
    return o @ w[b + "attn_output"].T  # (T, D)
