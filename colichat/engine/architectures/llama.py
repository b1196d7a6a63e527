"""llama (SmolLM2, Llama 2/3, Mistral, ...): GQA attention with RoPE, SwiGLU FFN. Axis letters:
engine/__init__.py. The cache rows per layer are the roped keys K then the values V (COLIGQA)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelError
from ..attention import gqa_attention
from ..cache import KVCache
from ..config import ModelConfig
from ..ffn import swiglu
from ..gguf.tensors import Tensors
from ..ops import linear, rms_norm
from ..rope import RopeParams, rope_norm, rope_rotations

CACHE_KIND = "gqa"


def config(key, common: dict, tensors: Tensors) -> ModelConfig:
    """llama has no keys beyond the common ones; its rope covers the whole head."""
    if common["rope_dim"] != common["head_dim"]:
        raise ModelError(f"{common['path']}: rope.dimension_count {common['rope_dim']} "
                         f"!= head size {common['head_dim']}")
    return ModelConfig(**common)


def cache_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Floats per token per layer in the cache: (A, B) = (G*E roped keys, G*E values)."""
    return cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim


def _expect(w: np.ndarray, shape: tuple, name: str, path: str) -> np.ndarray:
    if tuple(w.shape) != tuple(shape):
        raise ModelError(f"{path}: tensor '{name}' has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """Dequantize and fuse the llama weights: q|k|v into attn_qkv, gate|up into ffn_gate_up."""
    d, h, g, e, f = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
    p = cfg.path
    w: dict[str, np.ndarray] = {}
    w["token_embd"] = _expect(t.f32("token_embd.weight"), (cfg.n_vocab, d), "token_embd.weight", p)  # (V, D)
    w["output_norm"] = t.f32("output_norm.weight")
    if not cfg.tied_output:
        w["output"] = _expect(t.f32("output.weight"), (cfg.n_vocab, d), "output.weight", p)  # (V, D)
    if t.has("rope_freqs.weight"):
        w["rope_freqs"] = t.f32("rope_freqs.weight")  # (I,)
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        q = _expect(t.f32(b + "attn_q.weight"), (h * e, d), b + "attn_q.weight", p)
        k = _expect(t.f32(b + "attn_k.weight"), (g * e, d), b + "attn_k.weight", p)
        v = _expect(t.f32(b + "attn_v.weight"), (g * e, d), b + "attn_v.weight", p)
        w[b + "attn_qkv"] = np.concatenate([q, k, v])  # ((H+2G)E, D)
        if t.has(b + "attn_q.bias"):
            w[b + "attn_qkv.bias"] = np.concatenate(
                [t.f32(b + "attn_q.bias"), t.f32(b + "attn_k.bias"), t.f32(b + "attn_v.bias")]
            )
        w[b + "attn_output"] = _expect(t.f32(b + "attn_output.weight"), (d, h * e), b + "attn_output", p)
        w[b + "attn_norm"] = t.f32(b + "attn_norm.weight")
        w[b + "ffn_norm"] = t.f32(b + "ffn_norm.weight")
        gate = _expect(t.f32(b + "ffn_gate.weight"), (f, d), b + "ffn_gate.weight", p)
        up = _expect(t.f32(b + "ffn_up.weight"), (f, d), b + "ffn_up.weight", p)
        w[b + "ffn_gate_up"] = np.concatenate([gate, up])  # (2F, D)
        w[b + "ffn_down"] = _expect(t.f32(b + "ffn_down.weight"), (d, f), b + "ffn_down.weight", p)
        if progress:
            progress(l + 1, cfg.n_layer)
    return w


def llama_rope(cfg: ModelConfig) -> tuple[RopeParams, float]:
    """RoPE parameters and kq_scale = 1 / sqrt(E)."""
    yarn = cfg.rope_scaling == "yarn"
    params = RopeParams(
        n_dims=cfg.rope_dim,
        base=cfg.rope_base,
        freq_scale=1.0 / cfg.rope_factor,
        ext_factor=1.0 if yarn else 0.0,
        n_ctx_orig=cfg.rope_orig_ctx,
        attn_factor=cfg.rope_attn_factor,
    )
    return params, 1.0 / math.sqrt(cfg.head_dim)


class Forward:
    """The llama blocks of one Model (float32, BLAS)."""

    experts = None  # no routed experts
    exact_passes = True  # a pass of 2-16 tokens gives decode's rows bit for bit (ops.linear)

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        self.cfg, self.w = cfg, weights
        rope, self.kq_scale = llama_rope(cfg)
        self.rot = rope_rotations(rope, n_ctx, weights.get("rope_freqs"))  # (P, I) complex64

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        return linear(h, self.w[self.cfg.output_weight])  # (T, V)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache: KVCache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        t, h, g, e = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        qkv = linear(u, w[b + "attn_qkv"])  # (T, (H+2G)E)
        if b + "attn_qkv.bias" in w:
            qkv += w[b + "attn_qkv.bias"]
        rot = self.rot[pos0 : pos0 + t]  # (T, I)
        qk = rope_norm(qkv[:, : (h + g) * e].reshape(t, h + g, e), rot)  # (T, H+G, E) q and k heads
        q, k = qk[:, :h], qk[:, h:]  # (T, H, E), (T, G, E)
        n = pos0 + t
        kc, vc = cache.a[l], cache.b[l]  # (N, G*E) views
        kc[pos0:n] = k.reshape(t, g * e)
        vc[pos0:n] = qkv[:, (h + g) * e :]
        cache.round_rows(l, pos0, n)  # (a compact cache: what its file will give back)
        o = gqa_attention(q, kc[:n].reshape(n, g, e), vc[:n].reshape(n, g, e), pos0, self.kq_scale)  # (T, H*E)
        x = x + linear(o, w[b + "attn_output"])  # (T, D)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return x + swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])
