"""MTP (NextN) blocks: the draft head some deepseek2/deepseek32/glm-dsa files carry after the trunk.

docs/dsa-mtp-spec.md, "MTP (NextN) block". Block m is `blk.{n_layer + m}.`: its own attention and
FFN tensors (a full deepseek2 decoder block, dense attention, no indexer) plus `nextn.eh_proj`,
`nextn.enorm`, `nextn.hnorm` and optionally `nextn.embed_tokens`, `nextn.shared_head_norm`,
`nextn.shared_head_head`. The weights dict keeps them under their GGUF names without `.weight`
(`blk.3.nextn.eh_proj`, `blk.3.attn_in`, ...), like the trunk's.

MTP position q is fed (h_{q-1}, x_q): the trunk's hidden state of the previous position after
output_norm (zeros at q = 0) and the embedding of token q; its logits are the draft of token q+1.
The block attends over its own latent cache (one row per MTP position), which is never part of a
session file: after a load the draft state starts empty.

Axis letters: T tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import numpy as np

from .cache import KVCache
from .gguf import ModelError
from .ops import rms_norm

NEXTN_REQUIRED = ("eh_proj", "enorm", "hnorm")
NEXTN_OPTIONAL = ("embed_tokens", "shared_head_norm", "shared_head_head")


def prepare_block(cfg, t, l: int, get, w: dict) -> None:
    """Check and keep the nextn.* tensors of MTP block layer l (its decoder tensors are prepared
    like a trunk layer's)."""
    b, d, v = f"blk.{l}.nextn.", cfg.n_embd, cfg.n_vocab
    shapes = {"eh_proj": (d, 2 * d), "enorm": (d,), "hnorm": (d,),
              "embed_tokens": (v, d), "shared_head_norm": (d,), "shared_head_head": (v, d)}
    for name in NEXTN_REQUIRED + NEXTN_OPTIONAL:
        if name in NEXTN_REQUIRED or t.has(b + name + ".weight"):
            w[b + name] = get(b + name + ".weight", shapes[name])


class MTPBlock:
    """MTP block m of a loaded Model, with its own latent cache (n_ctx rows, never persisted)."""

    def __init__(self, model, m: int = 0):
        cfg = model.cfg
        if not 0 <= m < cfg.n_nextn:
            raise ValueError(f"{cfg.path} has {cfg.n_nextn} MTP blocks, not block {m}")
        if model.numerics != "fast":
            raise ModelError(f"{cfg.path}: the MTP block runs with the default numerics only")
        self.model, self.l = model, cfg.n_layer + m
        self.cache = KVCache("mla", 1, cfg.kv_lora_rank, cfg.rope_dim, model.n_ctx)

    def forward(self, h_prev: np.ndarray, tokens, pos0: int | None = None) -> np.ndarray:
        """Draft logits (T, V) for MTP positions pos0..pos0+T-1 (default: after its cached rows).

        h_prev: (T, D) the trunk's output_norm'd hidden states of positions pos0-1..pos0+T-2 (a
        zero row for position 0); tokens: (T,) the ids at positions pos0..pos0+T-1. Row i of the
        result is the draft of the token at position pos0+i+1. Writes the block's cache rows."""
        model, w, b = self.model, self.model.w, f"blk.{self.l}."
        cfg = model.cfg
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos0 = self.cache.length if pos0 is None else pos0
        if h_prev.shape != (ids.size, cfg.n_embd):
            raise ValueError(f"h_prev has shape {h_prev.shape}, expected ({ids.size}, {cfg.n_embd})")
        if not 0 <= pos0 <= self.cache.length or pos0 + ids.size > self.cache.capacity:
            raise ValueError(f"MTP position {pos0} with {ids.size} tokens does not follow its {self.cache.length} rows")
        e = w.get(b + "nextn.embed_tokens", w["token_embd"])[ids]  # (T, D)
        eh = np.concatenate([rms_norm(e, w[b + "nextn.enorm"], cfg.rms_eps),
                             rms_norm(h_prev.astype(np.float32), w[b + "nextn.hnorm"], cfg.rms_eps)], axis=1)
        u = eh @ w[b + "nextn.eh_proj"].T  # (T, D)
        self.cache.tokens[pos0 : pos0 + ids.size] = ids
        u = model.fwd.layer(self.l, u, pos0, self.cache, slot=0)  # (T, D), dense attention (no indexer)
        self.cache.length = pos0 + ids.size
        hn = rms_norm(u, w.get(b + "nextn.shared_head_norm", w["output_norm"]), cfg.rms_eps)
        return hn @ w.get(b + "nextn.shared_head_head", model.output).T  # (T, V)

    def truncate(self, n: int) -> None:
        """Drop rows past n (after a rejected draft, or a /rewind of the trunk)."""
        self.cache.truncate(min(n, self.cache.length))

    def reset(self) -> None:
        self.cache.reset()
