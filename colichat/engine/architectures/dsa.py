"""Sparse-attention MLA: deepseek32 (DeepSeek-V3.2) and glm-dsa (GLM-5.x). docs/dsa-mtp-spec.md.

Everything is deepseek2 (MLA, MoE, YaRN kq_scale) except that a layer's attention for query p
uses only the K keys the lightning indexer (indexer.py) selects. deepseek32: every layer owns a
full indexer (NEOX rope in the indexer); glm-dsa: the `indexer.types` layers do (1 = full), and
each other ("shared") layer reuses the selection of the nearest earlier full layer (NORM rope).
The cache record gains Ic, one indexer key per token for each full layer (cache.py).

The architecture module (ARCHITECTURES) for both: config, cache_widths, prepare and
Forward, built from deepseek2's pieces; Forward overrides deepseek2.Forward.select_keys, and
attend for passes of a few tokens.

Axis letters: engine/__init__.py; Hi indexer heads, Di indexer head size (indexer.py).
"""

from __future__ import annotations

import numpy as np

from ...errors import ModelError
from .. import indexer as I
from ..config import ModelConfig
from ..gguf.tensors import Tensors
from ..ops import SMALL_BATCH
from . import deepseek2

CACHE_KIND = deepseek2.CACHE_KIND
cache_widths = deepseek2.cache_widths

GLM_LONG_CONTEXT = 1048576  # glm-dsa files without indexer.types: all full below this context


def glm_5_2_types(n_layer: int) -> tuple[int, ...]:
    """GLM-5.2's default pattern: layers 0 and 1 full, then every fourth from 2 (2, 6, ..., 74)."""
    return tuple(1 if l < 2 or (l - 2) % 4 == 0 else 0 for l in range(n_layer))


def config(key, common: dict, tensors: Tensors) -> ModelConfig:
    """deepseek2's keys plus the indexer's (dsa-mtp-spec, Metadata). glm-dsa routes with sigmoid
    when expert_gating_func is absent."""
    arch = common["arch"]
    gating = {} if arch != "glm-dsa" or key("expert_gating_func", 0) else {"expert_gating": 2}
    cfg = ModelConfig(**common, **{**deepseek2.config_fields(key, common, tensors), **gating},
                      **config_fields(key, arch, common["n_layer"], common["n_ctx_train"], common["path"]))
    check_config(cfg, common["path"])
    return cfg


def config_fields(key, arch: str, n_layer: int, n_ctx_train: int, path: str) -> dict:
    """The indexer fields of ModelConfig from `{arch}.attention.indexer.*`. key(name, default,
    required, raw) reads "{arch}.{name}" (raw=True: an array as stored)."""
    hi = int(key("attention.indexer.head_count", required=True))
    di = int(key("attention.indexer.key_length", required=True))
    top_k = int(key("attention.indexer.top_k", required=True))
    if arch == "deepseek32":
        types = (1,) * n_layer
        eps = float(key("attention.layer_norm_epsilon", 1e-6))
    else:
        raw = key("attention.indexer.types", None, raw=True)
        if raw is not None:
            types = tuple(int(v) for v in (raw if isinstance(raw, list) else [raw] * n_layer))
        elif n_ctx_train < GLM_LONG_CONTEXT:
            types = (1,) * n_layer
        else:
            types = glm_5_2_types(n_layer)
        eps = float(key("attention.layer_norm_epsilon", 0.0))  # llama.cpp leaves it 0 for glm-dsa
    if len(types) < n_layer or any(v not in (0, 1) for v in types[:n_layer]):
        raise ModelError(f"{path}: attention.indexer.types must hold 0/1 for each of the {n_layer} layers")
    types = types[:n_layer]
    if not types or types[0] != 1:
        raise ModelError(f"{path}: the first layer must own a full indexer (attention.indexer.types)")
    if min(hi, di, top_k) <= 0:
        raise ModelError(f"{path}: indexer head_count {hi}, key_length {di}, top_k {top_k} must be positive")
    return dict(index_n_head=hi, index_head_dim=di, index_top_k=top_k, index_types=types,
                index_neox=arch == "deepseek32", index_eps=eps)


def check_config(cfg, path: str) -> None:
    """What the indexer needs beyond deepseek2: the q latent it reads, room for its rope part."""
    if not cfg.q_lora_rank:
        raise ModelError(f"{path}: sparse-attention MLA needs the q latent (attn_q_a), not attn_q")
    if cfg.index_head_dim < cfg.rope_dim:
        raise ModelError(f"{path}: indexer key_length {cfg.index_head_dim} < rope dims {cfg.rope_dim}")


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """deepseek2's weights (MTP blocks included) plus each full layer's indexer weights."""
    w = deepseek2.prepare(cfg, t, progress)

    get = t.get
    for l in range(cfg.n_layer):
        prepare_indexer(cfg, l, get, w)
    return w


def prepare_indexer(cfg: ModelConfig, l: int, get, w: dict) -> None:
    """The indexer weights of a full-indexer layer l (shapes checked), into w."""
    if not cfg.index_types[l]:
        return
    b, d, hi, di = f"blk.{l}.", cfg.n_embd, cfg.index_n_head, cfg.index_head_dim
    w[b + "indexer.attn_q_b"] = get(b + "indexer.attn_q_b.weight", (hi * di, cfg.q_lora_rank))  # (Hi*Di, Q)
    w[b + "indexer.attn_k"] = get(b + "indexer.attn_k.weight", (di, d))  # (Di, D)
    w[b + "indexer.k_norm"] = get(b + "indexer.k_norm.weight", (di,))
    w[b + "indexer.k_norm.bias"] = get(b + "indexer.k_norm.bias", (di,))
    w[b + "indexer.proj"] = get(b + "indexer.proj.weight", (hi, d))  # (Hi, D)


def index_slots(cfg) -> list[int]:
    """Per layer: its Ic slot in the record (full layers, in order), or -1 for a shared layer."""
    out, j = [], 0
    for full in cfg.index_types:
        out.append(j if full else -1)
        j += bool(full)
    return out


class Forward(deepseek2.Forward):
    """deepseek2's blocks, each query attending to the keys the indexer selects. Within one forward
    pass a full layer computes the selection (and writes its Ic rows), shared layers reuse it.

    A pass of 2..SMALL_BATCH tokens (a verify pass of speculative decoding, a short message) selects
    and attends for each query alone, as decoding does: its scores over the keys it sees, then
    attention over the rows it keeps (a batch's indexer scores and masked attention round
    differently from one token's). The projections, the indexer's included, stay batched (ops.linear
    gives each row decode's bits), so the pass's rows and logits are decode's, bit for bit."""

    exact_passes = True

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        super().__init__(cfg, weights, tensors, n_ctx, expert_cache_mib)
        self.slots = index_slots(cfg)
        self.keep: np.ndarray | None = None  # (T, N) bool of the last full layer of this pass
        self.query_keeps: list = []  # a small pass: each query's (1, N) selection (or None) of that layer
        self.sparse = True  # False: the indexer off, dense attention over every key (for comparisons)

    def attend(self, l, q_nope, q_pe, q_scale, u, qr, pos0, cache, kv):
        t = q_nope.shape[0]
        if not 1 < t <= SMALL_BATCH or l >= self.cfg.n_layer or not self.sparse:
            return super().attend(l, q_nope, q_pe, q_scale, u, qr, pos0, cache, kv)
        if self.slots[l] >= 0:  # a full layer: each query's own selection; a shared one reuses them
            q, hw = self.index_rows(l, u, qr, pos0, cache)
            ic = cache.ic[self.slots[l]]  # (N, Di)
            self.query_keeps = ([None] * t if q is None  # no query has more than K keys yet
                                else [self.selection(q[i : i + 1], hw[i : i + 1], ic, pos0 + i) for i in range(t)])
        out = []
        for i, keep in enumerate(self.query_keeps):  # query i as decode computes it, over keys 0..pos0+i
            rows, qpos, mask = restrict(kv[: pos0 + i + 1], keep, pos0 + i)
            out.append(self.mla(l, q_nope[i : i + 1], q_pe[i : i + 1],
                                None if q_scale is None else q_scale[i : i + 1], rows, qpos, mask))
        return np.concatenate(out)  # (T, H*Dv)

    def select_keys(self, l, u, qr, pos0, cache, kv):
        if l >= self.cfg.n_layer or not self.sparse:  # an MTP block attends densely over its own cache
            return kv, pos0, None
        return restrict(kv, self.select(l, u, qr, pos0, cache), pos0)

    def select(self, l: int, u: np.ndarray, qr: np.ndarray, pos0: int, cache) -> np.ndarray | None:
        """(T, N) bool: the keys the queries of layer l attend to, or None when that is every causal
        key (N <= K). u: (T, D) attn_norm output; qr: (T, Q) normed q latent. A full layer writes
        the new tokens' Ic rows into the cache first (decode reads the earlier ones from it); a
        shared layer reuses the last selection."""
        j = self.slots[l]
        if j < 0:
            assert self.keep is None or self.keep.shape[0] == u.shape[0]
            return self.keep
        q, hw = self.index_rows(l, u, qr, pos0, cache)
        self.keep = self.selection(q, hw, cache.ic[j], pos0)
        return self.keep

    def index_rows(self, l: int, u: np.ndarray, qr: np.ndarray, pos0: int, cache):
        """Full layer l's indexer projections of the new tokens: writes their Ic rows into the cache,
        returns the queries (T, Hi, Di) and head weights (T, Hi), or (None, None) while no query has
        more than K keys to choose from (nothing to score)."""
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        n = pos0 + u.shape[0]
        rot = self.rot[pos0:n]  # (T, I) the main rope's angles
        cache.ic[self.slots[l]][pos0:n] = I.indexer_keys(u, w[b + "indexer.attn_k"], w[b + "indexer.k_norm"],
                                                         w[b + "indexer.k_norm.bias"], cfg.index_eps, rot,
                                                         cfg.index_neox)
        if n <= cfg.index_top_k:
            return None, None
        q = I.indexer_queries(qr, w[b + "indexer.attn_q_b"], cfg.index_n_head, rot, cfg.index_neox)  # (T, Hi, Di)
        return q, I.indexer_head_weights(u, w[b + "indexer.proj"], cfg.index_head_dim)  # (T, Hi)

    def selection(self, q: np.ndarray | None, hw: np.ndarray | None, ic: np.ndarray, pos0: int) -> np.ndarray | None:
        """(T, N) bool: the K best-scoring keys of queries q (T, Hi, Di) with head weights hw (T, Hi) at
        positions pos0.., over the Ic rows ic (>= N rows); None when every causal key is kept (N <= K)."""
        if q is None or pos0 + q.shape[0] <= self.cfg.index_top_k:  # all causal keys kept: nothing to score
            return None
        n = pos0 + q.shape[0]
        return I.top_k_mask(I.indexer_scores(q, hw, ic[:n], pos0), self.cfg.index_top_k)


def restrict(kv: np.ndarray, keep: np.ndarray | None, pos0: int):
    """The attention inputs for a selection: (kv, pos0, mask) to hand to mla_absorbed/mla_naive.

    One query (decode) past K keys: gather the selected rows (attention then costs K, not N, per
    head), no mask. Otherwise the additive mask over all rows; keep None: plain causal attention.
    kv: (N, C+R); keep: (T, N) bool."""
    if keep is None:
        return kv, pos0, None
    t, n = keep.shape
    if t == 1:
        idx = np.flatnonzero(keep[0])
        if idx.size < n:
            return kv[idx], idx.size - 1, None
        return kv, pos0, None
    return kv, pos0, I.selection_mask(keep)
