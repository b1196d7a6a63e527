"""The forward pass per architecture: token ids in, logits out, the cache grows.

Axis letters: T new tokens, D model width (n_embd), V vocabulary, H query heads, G KV heads,
E head size, N cached tokens.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import gqa_attention
from .cache import KVCache
from .ffn import swiglu
from .gguf import ModelConfig, ModelError, Tensors
from .ops import rms_norm
from .rope import RopeParams, rope_norm, rope_tables

PREFILL_CHUNK = 512  # tokens per forward chunk: bounds the (H, T, N) score array of long prompts


def _expect(w: np.ndarray, shape: tuple, name: str, path: str) -> np.ndarray:
    if tuple(w.shape) != tuple(shape):
        raise ModelError(f"{path}: tensor '{name}' has shape {tuple(w.shape)}, expected {tuple(shape)}")
    return w


def prepare_llama(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """Dequantize and fuse the llama weights: q|k|v into attn_qkv, gate|up into ffn_gate_up."""
    d, h, g, e, f = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
    p = cfg.path
    w: dict[str, np.ndarray] = {}
    w["token_embd"] = _expect(t.f32("token_embd.weight"), (cfg.n_vocab, d), "token_embd.weight", p)
    w["output_norm"] = t.f32("output_norm.weight")
    if not cfg.tied_output:
        w["output"] = _expect(t.f32("output.weight"), (cfg.n_vocab, d), "output.weight", p)
    if t.has("rope_freqs.weight"):
        w["rope_freqs"] = t.f32("rope_freqs.weight")
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


def prepare_weights(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """The dense weights of an architecture, dequantized (routed experts of MoE models stay lazy)."""
    if cfg.arch == "llama":
        return prepare_llama(cfg, t, progress)
    raise ModelError(f"{cfg.path}: architecture '{cfg.arch}' has no forward pass yet")


def llama_rope(cfg: ModelConfig) -> RopeParams:
    yarn = cfg.rope_scaling == "yarn"
    return RopeParams(
        n_dims=cfg.rope_dim,
        base=cfg.rope_base,
        freq_scale=1.0 / cfg.rope_factor,
        ext_factor=1.0 if yarn else 0.0,
        n_ctx_orig=cfg.rope_orig_ctx,
        attn_factor=cfg.rope_attn_factor,
    )


class Model:
    """A loaded model with its cache. `prefill` appends tokens after the cached ones."""

    def __init__(
        self, cfg: ModelConfig, weights: dict, tokenizer, n_ctx: int, tensors: Tensors | None = None
    ):
        self.cfg = cfg
        self.w = weights
        self.tokenizer = tokenizer
        self.tensors = tensors
        self.n_ctx = n_ctx
        a, b = cfg.kv_widths
        self.cache = KVCache("mla" if cfg.is_mla else "gqa", cfg.n_layer, a, b, n_ctx)
        if cfg.arch == "llama":
            rope = llama_rope(cfg)
            self.kq_scale = 1.0 / math.sqrt(cfg.head_dim)
            self._layer = self._llama_layer
        else:
            raise ModelError(f"{cfg.path}: architecture '{cfg.arch}' has no forward pass yet")
        self.cos, self.sin = rope_tables(rope, n_ctx, weights.get("rope_freqs"))  # (N, I)
        self.output = weights.get("output", weights["token_embd"])  # (V, D)

    # --- public API -------------------------------------------------------------------------------

    def prefill(self, ids, all_logits: bool = True) -> np.ndarray:
        """Run new tokens after the cache; logits (T, V) for every new token, or (1, V) for the last."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        if ids.size > self.cache.room():
            raise ModelError(
                f"context full: {self.cache.length} + {ids.size} tokens exceed the context of {self.n_ctx}"
            )
        if ids.min() < 0 or ids.max() >= self.cfg.n_vocab:
            raise ValueError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        out = []
        for start in range(0, ids.size, PREFILL_CHUNK):
            chunk = ids[start : start + PREFILL_CHUNK]
            last = start + chunk.size == ids.size
            x = self._forward(chunk)  # (T, D)
            if all_logits:
                out.append(self._logits(x))
            elif last:
                out.append(self._logits(x[-1:]))
        return np.concatenate(out) if len(out) > 1 else out[0]

    def decode(self, token_id: int) -> np.ndarray:
        """One token after the cache: logits (V,)."""
        return self.prefill([token_id], all_logits=False)[0]

    def reset(self) -> None:
        self.cache.reset()

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in self.w.values())

    # --- internals --------------------------------------------------------------------------------

    def _forward(self, ids: np.ndarray) -> np.ndarray:
        pos0 = self.cache.length
        t = ids.size
        self.cache.tokens[pos0 : pos0 + t] = ids
        x = self.w["token_embd"][ids]  # (T, D)
        for l in range(self.cfg.n_layer):
            x = self._layer(l, x, pos0)
        self.cache.length = pos0 + t
        return x

    def _logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        return h @ self.output.T  # (T, V)

    def _llama_layer(self, l: int, x: np.ndarray, pos0: int) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        t, h, g, e = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        qkv = u @ w[b + "attn_qkv"].T  # (T, (H+2G)E)
        if b + "attn_qkv.bias" in w:
            qkv += w[b + "attn_qkv.bias"]
        cos, sin = self.cos[pos0 : pos0 + t], self.sin[pos0 : pos0 + t]  # (T, I)
        q = rope_norm(qkv[:, : h * e].reshape(t, h, e), cos, sin)  # (T, H, E)
        k = rope_norm(qkv[:, h * e : (h + g) * e].reshape(t, g, e), cos, sin)  # (T, G, E)
        n = pos0 + t
        kc, vc = self.cache.a[l], self.cache.b[l]  # (N, G*E) views
        kc[pos0:n] = k.reshape(t, g * e)
        vc[pos0:n] = qkv[:, (h + g) * e :]
        o = gqa_attention(q, kc[:n].reshape(n, g, e), vc[:n].reshape(n, g, e), pos0, self.kq_scale)
        x = x + o @ w[b + "attn_output"].T  # (T, D)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return x + swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])
