"""minicpm3 (MiniCPM3-4B): deepseek2's MLA with q compression, LongRoPE, scaled residuals, SwiGLU.

Per layer (llama.cpp src/models/minicpm3.cpp), with s = 1.4 / sqrt(n_layer):
    x += s * W_O MLA(rms_norm(x))                   # attn_q_a/_norm/_b, attn_kv_a_mqa, legacy attn_kv_b
    x += s * W_down (silu(W_gate u) * W_up u), u = rms_norm(x)
x starts as 12 * token_embd[ids]; logits = (256 / n_embd) * rms_norm(x) @ output^T;
kq_scale = 1/sqrt(qk_nope + qk_rope). RoPE is NEOX (pairs i, i + R/2) with LongRoPE frequency
factors: `rope_factors_long` for every position when the context size exceeds
rope.scaling.original_context_length, else `rope_factors_short` (llama.cpp's get_rope_factors).
The cache's k_pe rows carry the factors they were rotated with, so a resumed conversation keeps its
own (`use_rope_factors`; sessions record `rope_factors`, FORMAT.md): the long ones serve any
context size, the short ones at most the original context.
The three scales are constants in llama.cpp too (MiniCPM3's scale_emb, scale_depth, dim_model_base).
llama.cpp caches decompressed per-head keys and values for minicpm3; colichat keeps deepseek2's
latent cache (c and k_pe per token and layer, COLIKV1), the point of MLA. Everything else is
deepseek2's (config_fields, prepare, Forward.attention and its dense SwiGLU ffn).
Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelError
from ..cache import KVCache
from ..config import ModelConfig
from ..gguf.tensors import Tensors
from ..ops import linear, rms_norm
from ..rope import rope_neox, rope_rotations
from . import deepseek2, plm

CACHE_KIND = deepseek2.CACHE_KIND
cache_widths = deepseek2.cache_widths
config = plm.config  # deepseek2's MLA fields, every layer dense
SCALE_EMB = 12.0      # embeddings
SCALE_DEPTH = 1.4     # residual branches: SCALE_DEPTH / sqrt(n_layer)
DIM_MODEL_BASE = 256  # hidden state before the output matrix: DIM_MODEL_BASE / n_embd
ROPE_FACTORS = ("short", "long")  # rope_factors_short: contexts up to the original one; _long: any


def rope_factors_problem(cfg: ModelConfig, n_ctx: int, name) -> str | None:
    """Why a conversation whose cache rows were rotated with rope_factors_{name} cannot go on at
    context size n_ctx (one line), or None: the long factors serve any context size, the short ones
    at most the original context."""
    orig = cfg.rope_orig_ctx
    if name not in ROPE_FACTORS:
        return (f"its cache rows were rotated with rope factors {str(name)[:40]!r}, which minicpm3 does "
                f"not have (it has {' and '.join(ROPE_FACTORS)}): start a new conversation")
    if name == "short" and n_ctx > orig:
        return (f"it was made with the short rope factors, which serve a context size of at most {orig:,} "
                f"(this one is {n_ctx:,}): resume it with a context size of at most {orig:,}, or start a "
                "new conversation")
    return None


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """deepseek2's weights (every layer dense: gate|up fused) and both LongRoPE factor sets (the
    context size picks one when the model is built)."""
    w = deepseek2.prepare(cfg, t, progress)
    for name in ("rope_factors_long", "rope_factors_short"):
        if not t.has(name + ".weight"):
            raise ModelError(f"{cfg.path}: missing tensor '{name}.weight' (MiniCPM3's LongRoPE factors)")
        w[name] = t.f32(t.check(name + ".weight", (cfg.rope_dim // 2,)))  # (I,)
    return w


class Forward(deepseek2.Forward):
    """deepseek2's blocks with minicpm3's scales and NEOX LongRoPE; n_ctx picks the factors."""

    rope = staticmethod(rope_neox)

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        super().__init__(cfg, weights, tensors, n_ctx, expert_cache_mib)
        self.n_ctx = n_ctx
        self.default_rope_factors = "long" if n_ctx > cfg.rope_orig_ctx else "short"  # llama.cpp's choice
        self.use_rope_factors(self.default_rope_factors)
        self.kq_scale = 1.0 / math.sqrt(cfg.qk_head)
        self.res_scale = np.float32(SCALE_DEPTH / math.sqrt(cfg.n_layer))

    def use_rope_factors(self, name: str) -> None:
        """Rotate with rope_factors_{name} from now on ("short" or "long"; Model.use_rope_factors
        checks first that they serve this context size: rope_factors_problem)."""
        factors = self.w[f"rope_factors_{name}"]  # (I,)
        self.rot = rope_rotations(plm.rope_params(self.cfg), self.n_ctx, factors)  # (P, I) complex64
        self.rope_factors = name

    def layer(self, l: int, x: np.ndarray, pos0: int, cache: KVCache) -> np.ndarray:
        if l == 0:
            x = x * np.float32(SCALE_EMB)  # the scaled embeddings (Model looks up token_embd)
        a = self.attention(l, x, pos0, cache)  # (T, D)
        a *= self.res_scale
        x = x + a
        f = self.ffn(l, rms_norm(x, self.w[f"blk.{l}.ffn_norm"], self.cfg.rms_eps))  # (T, D)
        f *= self.res_scale
        return x + f

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        h *= np.float32(DIM_MODEL_BASE / self.cfg.n_embd)
        return linear(h, self.w[self.cfg.output_weight])  # (T, V)
