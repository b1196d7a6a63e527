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
from ..gguf.qmatrix import QMatrix, stack
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


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray | QMatrix]:
    """The llama weights: q|k|v stacked into attn_qkv, gate|up into ffn_gate_up. The matrices are
    t.matrix's (quantized where the kernels run, else f32); norms and biases f32."""
    d, h, g, e, f = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
    get = t.get
    w: dict = {}
    w["token_embd"] = get("token_embd.weight", (cfg.n_vocab, d), matrix=True)  # (V, D)
    w["output_norm"] = get("output_norm.weight", (d,))
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, d), matrix=True)  # (V, D)
    if t.has("rope_freqs.weight"):
        w["rope_freqs"] = t.f32("rope_freqs.weight")  # (I,)
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        q = get(b + "attn_q.weight", (h * e, d), matrix=True)
        k = get(b + "attn_k.weight", (g * e, d), matrix=True)
        v = get(b + "attn_v.weight", (g * e, d), matrix=True)
        w[b + "attn_qkv"] = stack([q, k, v])  # ((H+2G)E, D)
        if t.has(b + "attn_q.bias"):
            w[b + "attn_qkv.bias"] = np.concatenate(
                [t.f32(b + "attn_q.bias"), t.f32(b + "attn_k.bias"), t.f32(b + "attn_v.bias")]
            )
        w[b + "attn_output"] = get(b + "attn_output.weight", (d, h * e), matrix=True)  # (D, H*E)
        w[b + "attn_norm"] = get(b + "attn_norm.weight", (d,))
        w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
        gate = get(b + "ffn_gate.weight", (f, d), matrix=True)
        up = get(b + "ffn_up.weight", (f, d), matrix=True)
        w[b + "ffn_gate_up"] = stack([gate, up])  # (2F, D)
        w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f), matrix=True)  # (D, F)
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
        # where the compiled kernels multiply the matrices (the kernel path), decode's attention is compiled too
        self.compiled = any(isinstance(m, QMatrix) for m in weights.values())

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
        o = gqa_attention(q, kc[:n].reshape(n, g, e), vc[:n].reshape(n, g, e), pos0, self.kq_scale,
                          self.compiled)  # (T, H*E)
        x = x + linear(o, w[b + "attn_output"])  # (T, D)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return x + swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])
