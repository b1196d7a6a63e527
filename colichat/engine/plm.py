"""plm (PLM-1.8B): deepseek2's MLA without q compression and a dense squared-ReLU FFN.

Per layer (llama.cpp src/models/plm.cpp):
    x += W_O MLA(rms_norm(x))                       # attn_q, attn_kv_a_mqa, legacy attn_kv_b; NORM RoPE
    x += W_down relu(W_up rms_norm(x))^2            # ffn_up, ffn_down: no gate
logits = rms_norm(x) @ token_embd^T (output tied to the embedding); kq_scale = 1/sqrt(qk_nope + qk_rope).
The cache is deepseek2's latent cache: c and k_pe per token and layer (COLIKV1).

Axis letters: T tokens, D model width, F FFN width, V vocabulary.
"""

from __future__ import annotations

import math

import numpy as np

from .gguf import ModelConfig, Tensors
from .mla import mla_attention, prepare_mla_attention
from .ops import rms_norm
from .rope import RopeParams, rope_norm, rope_rotations

ARCHS = ("plm",)


def rope_params(cfg: ModelConfig) -> RopeParams:
    """llama.cpp's generic rope parameters (no deepseek2 YaRN temperature)."""
    return RopeParams(n_dims=cfg.rope_dim, base=cfg.rope_base, freq_scale=1.0 / cfg.rope_factor,
                      ext_factor=1.0 if cfg.rope_scaling == "yarn" else 0.0, n_ctx_orig=cfg.rope_orig_ctx,
                      attn_factor=cfg.rope_attn_factor)


def prepare_relu2_ffn(cfg: ModelConfig, get, b: str, w: dict) -> None:
    d, f = cfg.n_embd, cfg.n_ff
    w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
    w[b + "ffn_up"] = get(b + "ffn_up.weight", (f, d))  # (F, D)
    w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f))  # (D, F)


def relu2_ffn(u: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """W_down relu(W_up u)^2. u: (T, D); w_up: (F, D); w_down: (D, F)."""
    h = u @ w_up.T  # (T, F)
    np.maximum(h, 0.0, out=h)
    h *= h
    return h @ w_down.T  # (T, D)


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """The f32 weights: deepseek2's attention (legacy attn_kv_b split at load) and ffn_up/ffn_down."""

    def get(name: str, shape: tuple) -> np.ndarray:
        return t.f32(t.check(name, shape))

    w = {"token_embd": get("token_embd.weight", (cfg.n_vocab, cfg.n_embd)),
         "output_norm": get("output_norm.weight", (cfg.n_embd,))}
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, cfg.n_embd))
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        prepare_mla_attention(cfg, get, b, w)
        prepare_relu2_ffn(cfg, get, b, w)
        if progress:
            progress(l + 1, cfg.n_layer)
    return w


class Forward:
    """plm layers over the latent cache."""

    def __init__(self, cfg: ModelConfig, weights: dict, tensors=None, n_ctx: int = 0, expert_cache_mib=None):
        self.cfg, self.w = cfg, weights
        self.rot = rope_rotations(rope_params(cfg), n_ctx)  # (N, R/2) complex64
        self.kq_scale = 1.0 / math.sqrt(cfg.qk_head)
        self.output = weights.get("output", weights["token_embd"])  # (V, D)

    @property
    def cache_widths(self) -> tuple[int, int]:
        return self.cfg.kv_lora_rank, self.cfg.rope_dim

    def rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        return rope_norm(x, self.rot[pos0 : pos0 + x.shape[0]])

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.w["token_embd"][ids]  # (T, D)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        x = x + mla_attention(cfg, w, b, u, pos0, cache, l, self.rope, self.kq_scale)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return x + relu2_ffn(u, w[b + "ffn_up"], w[b + "ffn_down"])

    def logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.w["output_norm"], self.cfg.rms_eps) @ self.output.T  # (T, V)
