"""deepseek2 (DeepSeek-V2/V2.5/V3/R1, Kimi-K2, GLM-4.7-Flash, Mistral-Large-3, ...): multi-head
latent attention (MLA) over a compressed cache, YaRN kq_scale, dense then mixture-of-experts FFNs.
Math: docs/mla-spec.md. Axis letters: engine/__init__.py. The cache rows per layer are the
normalized latent c (C) then the roped shared key k_pe (R): the COLIKV1 record.

Architectures derived from deepseek2 (plm, minicpm3) import what they share from here (config_fields,
prepare_attention, prepare_layer, mla_rope, routing, Forward and its attention/ffn/rope members)
rather than copying it.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import ModelError
from ..attention import mla_absorbed, mla_naive, prefer_naive
from ..cache import KVCache
from ..config import ModelConfig
from ..ffn import PREFETCH_TOKENS, ExpertCache, Routing, moe, route, swiglu
from ..gguf.qmatrix import stack
from ..gguf.tensors import Tensors
from ..mapped_experts import MappedExperts, in_place
from ..mtp import prepare_block
from ..ops import linear, rms_norm
from ..rope import RopeParams, rope_norm, rope_rotations

CACHE_KIND = "mla"


def config(key, common: dict, tensors: Tensors) -> ModelConfig:
    """The deepseek2 keys (defaults are llama.cpp's; mla-spec section 1). MTP (nextn) blocks after
    the trunk (common["n_nextn"]) are prepared and kept for drafting (mtp.py)."""
    return ModelConfig(**common, **config_fields(key, common, tensors))


def config_fields(key, common: dict, tensors: Tensors) -> dict:
    """The MLA and MoE fields of ModelConfig, for deepseek2 and the architectures derived from it."""
    path, rope_dim, key_length = common["path"], common["rope_dim"], common["head_dim"]
    n_embd, n_head = common["n_embd"], common["n_head"]
    # head sizes from the *_mla keys when present (MLA-split files), else the legacy keys.
    d_qk = int(key("attention.key_length_mla", 0) or key_length)
    d_v = int(key("attention.value_length_mla", 0) or key("attention.value_length", n_embd // n_head))
    if d_qk <= rope_dim:
        raise ModelError(f"{path}: key length {d_qk} leaves no room for the rope part ({rope_dim})")
    mla_split = tensors.has("blk.0.attn_k_b.weight") and tensors.has("blk.0.attn_v_b.weight")
    if not mla_split and not tensors.has("blk.0.attn_kv_b.weight"):
        raise ModelError(f"{path}: missing tensor 'blk.0.attn_k_b.weight' (or legacy 'attn_kv_b')")
    # "lite" (no q compression) is decided by the tensors present, never by the layer count.
    lite = tensors.has("blk.0.attn_q.weight")
    if not lite and not tensors.has("blk.0.attn_q_a.weight"):
        raise ModelError(f"{path}: missing tensor 'blk.0.attn_q_a.weight' (or 'attn_q')")
    q_lora = 0 if lite else int(key("attention.q_lora_rank", 0) or tensors.shape("blk.0.attn_q_a.weight")[0])
    gating = int(key("expert_gating_func", 0) or 0)
    if gating == 0:
        # Absent: softmax (DeepSeek V2/V2.5 files), except GLM-4.7-Lite files (sigmoid). This shape
        # rule (47 or 48 layers and a 154880-token vocabulary) is exactly llama.cpp's own fallback for
        # deepseek2 files without expert_gating_func (llama-model.cpp, "GLM 4.7 Lite"); kept so the
        # routing matches llama.cpp on those files.
        gating = 2 if common["n_layer"] in (47, 48) and common["n_vocab"] == 154880 else 1
    if gating not in (1, 2):
        raise ModelError(f"{path}: expert gating function {gating} is not supported (1 softmax, 2 sigmoid)")
    return dict(
        q_lora_rank=q_lora,
        kv_lora_rank=int(key("attention.kv_lora_rank", required=True)),
        qk_nope=d_qk - rope_dim,
        qk_head=d_qk,
        v_head_dim=d_v,
        mla_split=mla_split,
        n_dense=int(key("leading_dense_block_count", 0)),
        n_expert=int(key("expert_count", 0)),
        n_expert_used=int(key("expert_used_count", 0)),
        n_expert_shared=int(key("expert_shared_count", 0)),
        n_ff_exp=int(key("expert_feed_forward_length", 0)),
        expert_weights_scale=float(key("expert_weights_scale", 0.0)),
        expert_weights_norm=bool(key("expert_weights_norm", False)),
        expert_gating=gating,
        n_group=int(key("expert_group_count", 0)),
        n_group_used=int(key("expert_group_used_count", 0)),
        attn_temp_scale=float(key("attention.temperature_scale", 0.0)),
        attn_temp_length=int(key("attention.temperature_length", 0)),
    )


def cache_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Floats per token per layer in the cache: (A, B) = (C latent, R rope key)."""
    return cfg.kv_lora_rank, cfg.rope_dim


def prepare(cfg: ModelConfig, t: Tensors, progress=None) -> dict:
    """The dense deepseek2 weights (see prepare_layer): the matrices as t.matrix gives them (quantized
    where the kernels run, else f32), the rest f32. Routed experts are only checked: they stay in the
    memory map (MappedExperts multiplies by them there, ExpertCache dequantizes them when routed to)."""
    get = t.get
    d = cfg.n_embd
    w: dict = {"token_embd": get("token_embd.weight", (cfg.n_vocab, d), matrix=True)}  # (V, D)
    w["output_norm"] = get("output_norm.weight", (d,))
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, d), matrix=True)  # (V, D)
    for l in range(cfg.n_layer + cfg.n_nextn):  # the trunk, then the MTP blocks (blk.{n_layer}..)
        prepare_layer(cfg, t, l, w, get)
        if l >= cfg.n_layer:
            prepare_block(cfg, t, l, get, w)
        if progress:
            progress(l + 1, cfg.n_layer + cfg.n_nextn)
    return w


def prepare_layer(cfg: ModelConfig, t: Tensors, l: int, w: dict, get) -> None:
    """One block's dense weights into w: the attention's (prepare_attention), gate|up stacked for a
    dense layer; the routed experts of MoE layers are checked."""
    d, b = cfg.n_embd, f"blk.{l}."
    prepare_attention(cfg, l, w, get)
    w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
    if l < cfg.n_dense:
        f = cfg.n_ff
        gate, up = get(b + "ffn_gate.weight", (f, d), True), get(b + "ffn_up.weight", (f, d), True)
        w[b + "ffn_gate_up"] = stack([gate, up])  # (2F, D)
        w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f), True)  # (D, F)
    else:
        _prepare_moe(cfg, t, b, w, get)


def prepare_attention(cfg: ModelConfig, l: int, w: dict, get) -> None:
    """One block's attention weights into w: stack q_a|kv_a_mqa (or q|kv_a_mqa) into attn_in, split
    legacy attn_kv_b into attn_k_b/attn_v_b (f32: absorbed into the attention). get(name, shape,
    matrix=False) returns the checked tensor (Tensors.get)."""
    d, h, c, r = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim
    dn, dv, k, rq = cfg.qk_nope, cfg.v_head_dim, cfg.qk_head, cfg.q_lora_rank
    b = f"blk.{l}."
    w[b + "attn_norm"] = get(b + "attn_norm.weight", (d,))
    kv_a = get(b + "attn_kv_a_mqa.weight", (c + r, d), True)  # (C+R, D)
    if rq:
        q_in = get(b + "attn_q_a.weight", (rq, d), True)  # (Q, D)
        w[b + "attn_q_a_norm"] = get(b + "attn_q_a_norm.weight", (rq,))
        w[b + "attn_q_b"] = get(b + "attn_q_b.weight", (h * k, rq), True)  # (H*K, Q)
    else:
        q_in = get(b + "attn_q.weight", (h * k, d), True)  # (H*K, D)
    w[b + "attn_in"] = stack([q_in, kv_a])  # (Q+C+R, D) or (H*K+C+R, D): one product
    del q_in, kv_a
    w[b + "attn_kv_a_norm"] = get(b + "attn_kv_a_norm.weight", (c,))
    if cfg.mla_split:
        w[b + "attn_k_b"] = get(b + "attn_k_b.weight", (h, c, dn))  # (H, C, Dn)
        w[b + "attn_v_b"] = get(b + "attn_v_b.weight", (h, dv, c))  # (H, Dv, C)
    else:  # legacy: per head [W_UK (Dn rows); W_UV (Dv rows)] (mla-spec 3.2)
        w3 = get(b + "attn_kv_b.weight", (h * (dn + dv), c)).reshape(h, dn + dv, c)
        w[b + "attn_k_b"] = np.ascontiguousarray(w3[:, :dn].transpose(0, 2, 1))  # (H, C, Dn)
        w[b + "attn_v_b"] = np.ascontiguousarray(w3[:, dn:])  # (H, Dv, C)
    w[b + "attn_output"] = get(b + "attn_output.weight", (d, h * dv), True)  # (D, H*Dv)


def _prepare_moe(cfg: ModelConfig, t: Tensors, b: str, w: dict, get) -> None:
    d, x, fe = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    if x <= 0 or not 0 < cfg.n_expert_used <= x:
        raise ModelError(f"{cfg.path}: layer {b[4:-1]} is MoE but expert_count {x}, used {cfg.n_expert_used}")
    if cfg.n_group > 1 and (x % cfg.n_group or not 0 < cfg.n_group_used <= cfg.n_group):
        raise ModelError(f"{cfg.path}: {x} experts do not form {cfg.n_group} groups, {cfg.n_group_used} used")
    w[b + "ffn_gate_inp"] = get(b + "ffn_gate_inp.weight", (x, d))  # (X, D) router, f32
    if t.has(b + "exp_probs_b.bias"):
        w[b + "exp_probs_b"] = get(b + "exp_probs_b.bias", (x,))  # (X,)
    if t.has(b + "ffn_gate_up_exps.weight"):
        t.check(b + "ffn_gate_up_exps.weight", (x, 2 * fe, d))  # (X, 2F, D)
    else:
        t.check(b + "ffn_gate_exps.weight", (x, fe, d))  # (X, F, D)
        t.check(b + "ffn_up_exps.weight", (x, fe, d))
    t.check(b + "ffn_down_exps.weight", (x, d, fe))  # (X, D, F)
    if cfg.n_expert_shared:
        fs = fe * cfg.n_expert_shared
        gate, up = get(b + "ffn_gate_shexp.weight", (fs, d), True), get(b + "ffn_up_shexp.weight", (fs, d), True)
        w[b + "ffn_gate_up_shexp"] = stack([gate, up])  # (2F, D)
        w[b + "ffn_down_shexp"] = get(b + "ffn_down_shexp.weight", (d, fs), True)  # (D, F)


def mla_rope(cfg: ModelConfig) -> tuple[RopeParams, float]:
    """deepseek2 RoPE parameters and kq_scale, as newer llama.cpp computes them (mla-spec 4.3-4.4).

    With YaRN all of the temperature goes into kq_scale = mscale^2 / sqrt(d_qk), mscale =
    1 + yarn_log_multiplier * ln(factor) (the GGUF stores 0.1 * mscale_all_dim), and the rotated
    pairs keep magnitude 1: the rope op's own (1 + 0.1 ln factor) is cancelled in its attn_factor.
    """
    yarn = cfg.rope_scaling == "yarn"
    f = cfg.rope_factor
    ln_f = math.log(f) if f > 1.0 else 0.0
    if yarn:  # llama-context: attn factor 1 (log-mul given) or get_mscale(f, 1), then cancelled
        af = (1.0 if cfg.yarn_log_mul != 0.0 else 1.0 + 0.1 * ln_f) / (1.0 + 0.1 * ln_f)
    else:
        af = 1.0
    af *= cfg.rope_attn_factor
    mscale = af * (1.0 + 0.1 * math.log(f)) * (1.0 + cfg.yarn_log_mul * math.log(f))
    params = RopeParams(
        n_dims=cfg.rope_dim,
        base=cfg.rope_base,
        freq_scale=1.0 / f,
        ext_factor=1.0 if yarn else 0.0,
        n_ctx_orig=cfg.rope_orig_ctx,
        attn_factor=af,
    )
    return params, mscale * mscale / math.sqrt(cfg.qk_head)


def routing(cfg: ModelConfig) -> Routing:
    """How the router picks experts, from the config (mla-spec 5.5)."""
    return Routing(
        n_used=cfg.n_expert_used,
        gating=cfg.expert_gating,
        norm=cfg.expert_weights_norm,
        scale=cfg.expert_weights_scale,
        n_group=cfg.n_group,
        n_group_used=cfg.n_group_used,
    )


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The layers with routed experts: all but the leading dense ones (MTP blocks included)."""
    return [l for l in range(cfg.n_layer + cfg.n_nextn) if l >= cfg.n_dense]


class Forward:
    """The deepseek2 blocks of one Model (float32, BLAS): rope table, kq_scale, routing, and the
    routed-expert cache (dequantized on demand from `tensors`, bounded by expert_cache_mib).
    `rope` rotates the rope parts (NORM pairs; a derived architecture may pair them otherwise)."""

    rope = staticmethod(rope_norm)  # (x (T, ..., R), rot (T, I)) -> rotated x
    exact_passes = True  # a pass of 2-16 tokens gives decode's rows bit for bit (ops.linear)

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        self.cfg, self.w = cfg, weights
        rope, self.kq_scale = mla_rope(cfg)
        self.routing = routing(cfg)
        self.experts: ExpertCache | MappedExperts | None = None
        layers = moe_layers(cfg)
        if layers:
            if tensors is None:
                raise ValueError("a MoE model needs its Tensors: routed experts are read on demand")
            if expert_cache_mib is None:
                raise ValueError("a MoE model needs the size of its expert cache")
            if in_place(tensors, layers):  # the kernel path: experts multiplied where the map holds them
                self.experts = MappedExperts(tensors, layers)
            else:
                self.experts = ExpertCache(tensors, layers, int(expert_cache_mib * (1 << 20)))
        if cfg.attn_temp_scale and cfg.attn_temp_length <= 0:
            raise ModelError(f"{cfg.path}: attention.temperature_scale set without temperature_length")
        self.rot = rope_rotations(rope, n_ctx, weights.get("rope_freqs"))  # (P, I) complex64

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        return linear(h, self.w[self.cfg.output_weight])  # (T, V)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache: KVCache, slot: int | None = None) -> np.ndarray:
        """One block (mla-spec 5.2-5.5): MLA over the latent cache, then the FFN. slot: the cache
        layer to use when it is not l (an MTP block's own cache, mtp.py)."""
        x = x + self.attention(l, x, pos0, cache, slot)  # (T, D)
        u = rms_norm(x, self.w[f"blk.{l}.ffn_norm"], self.cfg.rms_eps)  # (T, D)
        return x + self.ffn(l, u, x)

    def ahead(self, n: int, x: np.ndarray | None) -> tuple[int, list[int]] | None:
        """(n, the experts layer n's router picks for residual x), to prefetch while layer n-1 computes: the
        residual changes little from one layer to the next. None where nothing is prefetched."""
        e = self.experts
        if x is None or e is None or e.prefetcher is None or x.shape[0] > PREFETCH_TOKENS or n not in e.layers:
            return None
        w, b = self.w, f"blk.{n}."
        u = rms_norm(x, w[b + "ffn_norm"], self.cfg.rms_eps)  # (T, D) as layer n will norm its input
        ids, _ = route(u, w[b + "ffn_gate_inp"], w.get(b + "exp_probs_b"), self.routing)  # (T, U)
        return n, np.unique(ids).tolist()

    def attention(self, l: int, x: np.ndarray, pos0: int, cache: KVCache, slot: int | None = None) -> np.ndarray:
        """MLA (absorbed form, or the decompressed one for long prefill chunks) over the keys
        select_keys leaves; writes the cache rows pos0..pos0+T-1 of layer l (or of `slot`).
        x: (T, D) -> (T, D), before the residual add."""
        slot = l if slot is None else slot
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        t, h, c, dn, k = x.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_head
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        z = linear(u, w[b + "attn_in"])  # (T, Q+C+R) or (T, H*K+C+R)
        nq = z.shape[1] - c - cfg.rope_dim
        qr = None
        if cfg.q_lora_rank:
            qr = rms_norm(z[:, :nq], w[b + "attn_q_a_norm"], cfg.rms_eps)  # (T, Q) normed q latent
            q = linear(qr, w[b + "attn_q_b"])  # (T, H*K)
        else:
            q = z[:, :nq]  # (T, H*K)
        q = q.reshape(t, h, k)  # (T, H, K): per head [nope (Dn) | rope (R)]
        rot = self.rot[pos0 : pos0 + t]  # (T, I)
        q_pe = self.rope(q[:, :, dn:], rot)  # (T, H, R)
        n = pos0 + t
        cache.a[slot][pos0:n] = rms_norm(z[:, nq : nq + c], w[b + "attn_kv_a_norm"], cfg.rms_eps)  # c (T, C)
        cache.b[slot][pos0:n] = self.rope(z[:, nq + c :], rot)  # k_pe (T, R)
        cache.round_rows(slot, pos0, n)  # (a compact cache: what its file will give back)
        q_scale = None
        if cfg.attn_temp_scale:  # Mistral-Large-3: 1 + tau * ln(floor(p / length) + 1) per query
            p = np.arange(pos0, n, dtype=np.float64)
            q_scale = (1.0 + cfg.attn_temp_scale * np.log(np.floor(p / cfg.attn_temp_length) + 1.0))
            q_scale = q_scale.astype(np.float32)  # (T,)
        kv = cache.records["kv"][:n, slot]  # (N, C+R) view of the cache rows [c | k_pe]
        o = self.attend(l, q[:, :, :dn], q_pe, q_scale, u, qr, pos0, cache, kv)  # (T, H*Dv)
        return linear(o, w[b + "attn_output"])  # (T, D)

    def attend(self, l: int, q_nope: np.ndarray, q_pe: np.ndarray, q_scale: np.ndarray | None, u: np.ndarray,
               qr: np.ndarray | None, pos0: int, cache: KVCache, kv: np.ndarray) -> np.ndarray:
        """MLA of layer l's queries over the keys select_keys leaves of kv (N, C+R), the cache rows
        with the new ones written. q_nope (T, H, Dn), q_pe (T, H, R) roped, q_scale (T,) or None;
        u, qr: as select_keys takes them. Returns (T, H*Dv)."""
        kv, qpos, mask = self.select_keys(l, u, qr, pos0, cache, kv)
        return self.mla(l, q_nope, q_pe, q_scale, kv, qpos, mask)

    def mla(self, l: int, q_nope, q_pe, q_scale, kv: np.ndarray, qpos: int, mask: np.ndarray | None) -> np.ndarray:
        """The attention of `attend` over the rows kv (M, C+R), the first query at row qpos, with an
        additive (T, M) mask or None (causal). Returns (T, H*Dv)."""
        cfg, b = self.cfg, f"blk.{l}."
        k_b, v_b = self.w[b + "attn_k_b"], self.w[b + "attn_v_b"]  # (H, C, Dn), (H, Dv, C)
        # decode and short chunks: absorbed; long prefill chunks: decompressed (faster there)
        naive = prefer_naive(q_nope.shape[0], kv.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.v_head_dim)
        form = mla_naive if naive else mla_absorbed
        return form(q_nope, q_pe, kv, k_b, v_b, qpos, self.kq_scale, q_scale, mask)

    def select_keys(self, l: int, u: np.ndarray, qr: np.ndarray | None, pos0: int, cache: KVCache,
                    kv: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
        """The keys layer l's queries attend to, as (kv rows, position of the first query in them,
        additive (T, N) mask or None for causal): every cached one here. Sparse attention (dsa.py)
        overrides this. u: (T, D) attn_norm output; qr: (T, Q) normed q latent (None without q_lora)."""
        return kv, pos0, None

    def ffn(self, l: int, u: np.ndarray, x: np.ndarray | None = None) -> np.ndarray:
        """A dense SwiGLU (leading layers) or routed + shared experts. u: (T, D) normed -> (T, D). x: the
        residual u was normed from, from which short passes predict the next layer's experts."""
        w, b = self.w, f"blk.{l}."
        if l < self.cfg.n_dense:
            return swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])
        ids, wts = route(u, w[b + "ffn_gate_inp"], w.get(b + "exp_probs_b"), self.routing)  # (T, U) x2
        out = moe(u, ids, wts, l, self.experts, self.ahead(l + 1, x))  # (T, D)
        if b + "ffn_gate_up_shexp" in w:
            out += swiglu(u, w[b + "ffn_gate_up_shexp"], w[b + "ffn_down_shexp"])
        return out
