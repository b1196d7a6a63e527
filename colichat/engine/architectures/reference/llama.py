"""llama with llama.cpp's arithmetic: the same block as llama.Forward.layer, computed with the ops
of ggml_ops.py in the order llama.cpp's graph runs them (`load(..., numerics="llama.cpp")`).

Weights are read as the GGUF stores them (F32, Q8_0, Q4_1: the default model; the K-quants and IQ4 within
a bound, ggml_ops.INT8_KINDS); the cache holds the same K and V rows as the fast path. Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import numpy as np

from ....errors import ModelError
from ...cache import KVCache
from ...config import ModelConfig
from ...gguf.tensors import Tensors
from ...ops import causal_mask
from ..llama import llama_rope
from . import ggml_ops as G

F32 = np.float32
MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Forward:
    """The llama blocks of one Model in llama.cpp's arithmetic (same interface as llama.Forward)."""

    experts = None

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        if tensors is None:
            raise ValueError("llama.cpp numerics read the weights as stored: the Model needs its Tensors")
        if tensors.has("blk.0.attn_q.bias"):
            raise ModelError(f"{cfg.path}: llama.cpp numerics do not cover attention biases")
        rope, kq_scale = llama_rope(cfg)
        self.cfg, self.w = cfg, weights
        self.kq_scale = F32(kq_scale)
        self.cos, self.sin = G.rope_cache(rope, n_ctx, weights.get("rope_freqs"))  # (P, I) each
        self.output = cfg.output_weight + ".weight"
        names = [f"blk.{l}.{m}.weight" for l in range(cfg.n_layer) for m in MATMULS] + [self.output]
        G.require_kinds(tensors, names)
        self.mats = {name: G.read_weight(tensors, name) for name in names}

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = G.rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        return self.mats[self.output](h)  # (T, V)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache: KVCache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        mat = {m: self.mats[f"{b}{m}.weight"] for m in MATMULS}
        t, h, g, e = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        n = pos0 + t
        u = G.rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        cos, sin = self.cos[pos0:n], self.sin[pos0:n]
        q = G.rope_norm(mat["attn_q"](u).reshape(t, h, e), cos, sin)  # (T, H, E)
        cache.a[l][pos0:n] = G.rope_norm(mat["attn_k"](u).reshape(t, g, e), cos, sin).reshape(t, g * e)
        cache.b[l][pos0:n] = mat["attn_v"](u)  # (T, G*E)
        k = np.ascontiguousarray(cache.a[l][:n]).reshape(n, g, e)  # (N, G, E)
        v = np.ascontiguousarray(cache.b[l][:n]).reshape(n, g, e)
        mask = causal_mask(pos0, t, n)  # (T, N)
        heads = [G.attention_head(np.ascontiguousarray(q[:, i]), np.ascontiguousarray(k[:, i // (h // g)]),
                                  np.ascontiguousarray(v[:, i // (h // g)]), mask, self.kq_scale)
                 for i in range(h)]  # query head i reads KV head i // (H/G), as ggml broadcasts
        x = (x + mat["attn_output"](np.concatenate(heads, axis=1))).astype(F32)  # (T, D)
        u = G.rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return (x + mat["ffn_down"](G.silu_mul(mat["ffn_gate"](u), mat["ffn_up"](u)))).astype(F32)
