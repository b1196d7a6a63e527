"""plm (PLM-1.8B): deepseek2's MLA without q compression and a dense squared-ReLU FFN.

Per layer (llama.cpp src/models/plm.cpp):
    x += W_O MLA(rms_norm(x))                       # attn_q, attn_kv_a_mqa, legacy attn_kv_b; NORM RoPE
    x += W_down relu(W_up rms_norm(x))^2            # ffn_up, ffn_down: no gate
logits = rms_norm(x) @ token_embd^T (output tied to the embedding); kq_scale = 1/sqrt(qk_nope + qk_rope).
The cache is deepseek2's latent cache: c and k_pe per token and layer (COLIKV1). Everything but the
FFN and the rope parameters is deepseek2's (config_fields, prepare_attention, Forward.attention).
Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import ModelConfig
from ..gguf.tensors import Tensors
from ..ops import linear
from ..rope import RopeParams, rope_rotations
from . import deepseek2

CACHE_KIND = deepseek2.CACHE_KIND
cache_widths = deepseek2.cache_widths


def config(key, common: dict, tensors: Tensors) -> ModelConfig:
    """deepseek2's MLA fields; every layer is dense (no experts)."""
    return ModelConfig(**common, **{**deepseek2.config_fields(key, common, tensors), "n_dense": common["n_layer"]})


def rope_params(cfg: ModelConfig) -> RopeParams:
    """llama.cpp's generic rope parameters (deepseek2's YaRN temperature does not apply)."""
    return RopeParams(n_dims=cfg.rope_dim, base=cfg.rope_base, freq_scale=1.0 / cfg.rope_factor,
                      ext_factor=1.0 if cfg.rope_scaling == "yarn" else 0.0, n_ctx_orig=cfg.rope_orig_ctx,
                      attn_factor=cfg.rope_attn_factor)


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """deepseek2's attention weights (legacy attn_kv_b split at load) and ffn_up/ffn_down."""

    get = t.get
    d, f = cfg.n_embd, cfg.n_ff
    w = {"token_embd": get("token_embd.weight", (cfg.n_vocab, d), True), "output_norm": get("output_norm.weight", (d,))}
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, d), True)  # (V, D)
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        deepseek2.prepare_attention(cfg, l, w, get)
        w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
        w[b + "ffn_up"] = get(b + "ffn_up.weight", (f, d), True)  # (F, D)
        w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f), True)  # (D, F)
        if progress:
            progress(l + 1, cfg.n_layer)
    return w


def relu2_ffn(u: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """W_down relu(W_up u)^2. u: (T, D); w_up: (F, D); w_down: (D, F)."""
    h = linear(u, w_up)  # (T, F)
    np.maximum(h, 0.0, out=h)
    h *= h
    return linear(h, w_down)  # (T, D)


class Forward(deepseek2.Forward):
    """deepseek2's blocks with plm's FFN, rope parameters and kq_scale."""

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        super().__init__(cfg, weights, tensors, n_ctx, expert_cache_mib)
        self.rot = rope_rotations(rope_params(cfg), n_ctx)  # (P, I) complex64
        self.kq_scale = 1.0 / math.sqrt(cfg.qk_head)

    def ffn(self, l: int, u: np.ndarray, x: np.ndarray | None = None) -> np.ndarray:
        b = f"blk.{l}."
        return relu2_ffn(u, self.w[b + "ffn_up"], self.w[b + "ffn_down"])
