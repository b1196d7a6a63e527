"""minicpm3 (MiniCPM3-4B): deepseek2's MLA with q compression, LongRoPE, scaled residuals, SwiGLU.

Per layer (llama.cpp src/models/minicpm3.cpp), with s = 1.4 / sqrt(n_layer):
    x += s * W_O MLA(rms_norm(x))                   # attn_q_a/_norm/_b, attn_kv_a_mqa, legacy attn_kv_b
    x += s * W_down (silu(W_gate u) * W_up u), u = rms_norm(x)
x starts as 12 * token_embd[ids]; logits = (256 / n_embd) * rms_norm(x) @ output^T;
kq_scale = 1/sqrt(qk_nope + qk_rope). RoPE is NEOX (pairs i, i + R/2) with LongRoPE frequency
factors: `rope_factors_long` for every position when the context size exceeds
rope.scaling.original_context_length, else `rope_factors_short` (llama.cpp's get_rope_factors).
The three scales are constants in llama.cpp too (MiniCPM3's scale_emb, scale_depth, dim_model_base).
llama.cpp caches decompressed per-head keys and values for minicpm3; colichat keeps deepseek2's
latent cache (c and k_pe per token and layer, COLIKV1), the point of MLA.

Axis letters: T tokens, D model width, F FFN width, V vocabulary, R qk_rope.
"""

from __future__ import annotations

import math

import numpy as np

from .ffn import swiglu
from .gguf import ModelConfig, ModelError, Tensors
from .mla import mla_attention, prepare_mla_attention
from .ops import rms_norm
from .plm import rope_params
from .rope import rope_neox, rope_rotations

ARCHS = ("minicpm3",)
SCALE_EMB = 12.0     # embeddings
SCALE_DEPTH = 1.4    # residual branches: SCALE_DEPTH / sqrt(n_layer)
DIM_MODEL_BASE = 256  # hidden state before the output matrix: DIM_MODEL_BASE / n_embd


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """The f32 weights: deepseek2's attention (legacy attn_kv_b split at load), gate|up fused, and
    both LongRoPE factor sets (the context size chooses one when the model is built)."""
    d, f = cfg.n_embd, cfg.n_ff

    def get(name: str, shape: tuple) -> np.ndarray:
        return t.f32(t.check(name, shape))

    w = {"token_embd": get("token_embd.weight", (cfg.n_vocab, d)), "output_norm": get("output_norm.weight", (d,))}
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, d))
    for name in ("rope_factors_long", "rope_factors_short"):
        if not t.has(name + ".weight"):
            raise ModelError(f"{cfg.path}: missing tensor '{name}.weight' (MiniCPM3's LongRoPE factors)")
        w[name] = get(name + ".weight", (cfg.rope_dim // 2,))  # (R/2,)
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        prepare_mla_attention(cfg, get, b, w)
        w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
        gate, up = get(b + "ffn_gate.weight", (f, d)), get(b + "ffn_up.weight", (f, d))
        w[b + "ffn_gate_up"] = np.concatenate([gate, up])  # (2F, D)
        w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f))  # (D, F)
        if progress:
            progress(l + 1, cfg.n_layer)
    return w


class Forward:
    """minicpm3 layers over the latent cache; the context size n_ctx picks the LongRoPE factors."""

    def __init__(self, cfg: ModelConfig, weights: dict, tensors=None, n_ctx: int = 0, expert_cache_mib=None):
        self.cfg, self.w = cfg, weights
        self.long_factors = n_ctx > cfg.rope_orig_ctx
        factors = weights["rope_factors_long" if self.long_factors else "rope_factors_short"]
        self.rot = rope_rotations(rope_params(cfg), n_ctx, factors)  # (N, R/2) complex64
        self.kq_scale = 1.0 / math.sqrt(cfg.qk_head)
        self.res_scale = np.float32(SCALE_DEPTH / math.sqrt(cfg.n_layer))
        self.output = weights.get("output", weights["token_embd"])  # (V, D)

    @property
    def cache_widths(self) -> tuple[int, int]:
        return self.cfg.kv_lora_rank, self.cfg.rope_dim

    def rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        return rope_neox(x, self.rot[pos0 : pos0 + x.shape[0]])

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.w["token_embd"][ids] * np.float32(SCALE_EMB)  # (T, D)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        a = mla_attention(cfg, w, b, u, pos0, cache, l, self.rope, self.kq_scale)  # (T, D)
        a *= self.res_scale
        x = x + a
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        f = swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])  # (T, D)
        f *= self.res_scale
        return x + f

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        h *= np.float32(DIM_MODEL_BASE / self.cfg.n_embd)
        return h @ self.output.T  # (T, V)
