"""The forward pass per architecture: token ids in, logits out, the cache grows.

Axis letters: T new tokens, D model width (n_embd), V vocabulary, H query heads, G KV heads,
E head size, N cached tokens; MLA (deepseek2): Q q_lora_rank, C kv_lora_rank, R qk_rope,
Dn qk_nope, K = Dn + R (q head), Dv v head, F FFN width, X routed experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .attention import gqa_attention, mla_absorbed, mla_naive, prefer_naive
from .cache import KVCache
from .ffn import ExpertCache, Routing, moe, route, swiglu
from .gguf import ModelConfig, ModelError, Tensors
from .ops import linear, rms_norm
from .rope import RopeParams, rope_norm, rope_rotations
from .threads import ThreadPolicy

PREFILL_CHUNK = 512  # tokens per forward chunk: bounds the (H, T, N) score array of long prompts
DEFAULT_EXPERT_CACHE_MIB = 4096  # dequantized routed experts kept (LRU) when nobody says (load() sizes it from memory)


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


def prepare_deepseek2(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """Dequantize the dense deepseek2 weights; fuse q_a|kv_a_mqa (or q|kv_a_mqa) into attn_in,
    split legacy attn_kv_b into attn_k_b/attn_v_b, fuse gate|up. Routed experts are only checked:
    they stay quantized in the memory map (ExpertCache dequantizes them when routed to)."""
    d, h, c, r = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.rope_dim
    dn, dv, k, rq = cfg.qk_nope, cfg.v_head_dim, cfg.qk_head, cfg.q_lora_rank

    def get(name: str, shape: tuple) -> np.ndarray:
        return t.f32(t.check(name, shape))

    w: dict[str, np.ndarray] = {"token_embd": get("token_embd.weight", (cfg.n_vocab, d))}
    w["output_norm"] = get("output_norm.weight", (d,))
    if not cfg.tied_output:
        w["output"] = get("output.weight", (cfg.n_vocab, d))
    for l in range(cfg.n_layer):
        b = f"blk.{l}."
        w[b + "attn_norm"] = get(b + "attn_norm.weight", (d,))
        kv_a = get(b + "attn_kv_a_mqa.weight", (c + r, d))  # (C+R, D)
        if rq:
            q_in = get(b + "attn_q_a.weight", (rq, d))  # (Q, D)
            w[b + "attn_q_a_norm"] = get(b + "attn_q_a_norm.weight", (rq,))
            w[b + "attn_q_b"] = get(b + "attn_q_b.weight", (h * k, rq))  # (H*K, Q)
        else:
            q_in = get(b + "attn_q.weight", (h * k, d))  # (H*K, D)
        w[b + "attn_in"] = np.concatenate([q_in, kv_a])  # (Q+C+R, D) or (H*K+C+R, D): one matmul
        del q_in, kv_a
        w[b + "attn_kv_a_norm"] = get(b + "attn_kv_a_norm.weight", (c,))
        if cfg.mla_split:
            w[b + "attn_k_b"] = get(b + "attn_k_b.weight", (h, c, dn))  # (H, C, Dn)
            w[b + "attn_v_b"] = get(b + "attn_v_b.weight", (h, dv, c))  # (H, Dv, C)
        else:  # legacy: per head [W_UK (Dn rows); W_UV (Dv rows)] (mla-spec 3.2)
            w3 = get(b + "attn_kv_b.weight", (h * (dn + dv), c)).reshape(h, dn + dv, c)
            w[b + "attn_k_b"] = np.ascontiguousarray(w3[:, :dn].transpose(0, 2, 1))  # (H, C, Dn)
            w[b + "attn_v_b"] = np.ascontiguousarray(w3[:, dn:])  # (H, Dv, C)
        w[b + "attn_output"] = get(b + "attn_output.weight", (d, h * dv))  # (D, H*Dv)
        w[b + "ffn_norm"] = get(b + "ffn_norm.weight", (d,))
        if l < cfg.n_dense:
            f = cfg.n_ff
            gate, up = get(b + "ffn_gate.weight", (f, d)), get(b + "ffn_up.weight", (f, d))
            w[b + "ffn_gate_up"] = np.concatenate([gate, up])  # (2F, D)
            w[b + "ffn_down"] = get(b + "ffn_down.weight", (d, f))  # (D, F)
        else:
            _prepare_moe(cfg, t, b, w, get)
        if progress:
            progress(l + 1, cfg.n_layer)
    return w


def _prepare_moe(cfg: ModelConfig, t: Tensors, b: str, w: dict, get) -> None:
    d, x, fe = cfg.n_embd, cfg.n_expert, cfg.n_ff_exp
    if x <= 0 or not 0 < cfg.n_expert_used <= x:
        raise ModelError(f"{cfg.path}: layer {b[4:-1]} is MoE but expert_count {x}, used {cfg.n_expert_used}")
    if cfg.n_group > 1 and (x % cfg.n_group or not 0 < cfg.n_group_used <= cfg.n_group):
        raise ModelError(f"{cfg.path}: {x} experts do not form {cfg.n_group} groups, {cfg.n_group_used} used")
    w[b + "ffn_gate_inp"] = get(b + "ffn_gate_inp.weight", (x, d))  # (X, D) router, f32
    if t.has(b + "exp_probs_b.bias"):
        w[b + "exp_probs_b"] = get(b + "exp_probs_b.bias", (x,))
    if t.has(b + "ffn_gate_up_exps.weight"):
        t.check(b + "ffn_gate_up_exps.weight", (x, 2 * fe, d))
    else:
        t.check(b + "ffn_gate_exps.weight", (x, fe, d))
        t.check(b + "ffn_up_exps.weight", (x, fe, d))
    t.check(b + "ffn_down_exps.weight", (x, d, fe))
    if cfg.n_expert_shared:
        fs = fe * cfg.n_expert_shared
        gate, up = get(b + "ffn_gate_shexp.weight", (fs, d)), get(b + "ffn_up_shexp.weight", (fs, d))
        w[b + "ffn_gate_up_shexp"] = np.concatenate([gate, up])  # (2F, D)
        w[b + "ffn_down_shexp"] = get(b + "ffn_down_shexp.weight", (d, fs))  # (D, F)


def prepare_weights(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """The dense weights of an architecture, dequantized (routed experts of MoE models stay lazy)."""
    if cfg.arch == "llama":
        return prepare_llama(cfg, t, progress)
    if cfg.arch == "deepseek2":
        return prepare_deepseek2(cfg, t, progress)
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


@dataclass(frozen=True)
class MemoryEstimate:
    """What a loaded model needs in memory (bytes), for the load message."""

    dense: int          # dequantized f32 weights held by the model
    experts: int        # bound of the routed-expert cache (0 without MoE)
    experts_f32: int    # what all routed experts would take as f32 (not held)
    kv_per_token: int   # cache bytes per token (record: token id + every layer's rows)
    n_ctx: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.kv_per_token * self.n_ctx

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / (1 << 20):,.0f} MiB"

        s = f"weights {mib(self.dense)}"
        if self.experts_f32:
            s += f" + expert cache <= {mib(self.experts)} (all experts as f32: {mib(self.experts_f32)})"
        s += f" + KV {self.kv_per_token:,} B/token x {self.n_ctx} = {mib(self.kv_per_token * self.n_ctx)}"
        return s + f"; total <= {mib(self.total)}"


class Model:
    """A loaded model with its cache. `prefill` appends tokens after the cached ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict,
        tokenizer,
        n_ctx: int,
        tensors: Tensors | None = None,
        expert_cache: float | None = None,
        numerics: str = "fast",
    ):
        """expert_cache: MiB of dequantized routed experts to keep (MoE models; default
        DEFAULT_EXPERT_CACHE_MIB). Routed experts are read from `tensors` (the GGUF memory map).
        numerics: "fast" (float32 math, BLAS) or "llama.cpp" (llama.cpp's CPU arithmetic reproduced
        op by op, see ggml_ops.py; slow, for checking against llama.cpp)."""
        self.cfg = cfg
        self.w = weights
        self.tokenizer = tokenizer
        self.tensors = tensors
        self.n_ctx = n_ctx
        a, b = cfg.kv_widths
        self.cache = KVCache("mla" if cfg.is_mla else "gqa", cfg.n_layer, a, b, n_ctx)
        self.experts: ExpertCache | None = None
        if cfg.arch == "llama":
            rope = llama_rope(cfg)
            self.kq_scale = 1.0 / math.sqrt(cfg.head_dim)
            self._layer = self._llama_layer
        elif cfg.arch == "deepseek2":
            rope, self.kq_scale = mla_rope(cfg)
            self._layer = self._mla_layer
            self.routing = Routing(
                n_used=cfg.n_expert_used,
                gating=cfg.expert_gating,
                norm=cfg.expert_weights_norm,
                scale=cfg.expert_weights_scale,
                n_group=cfg.n_group,
                n_group_used=cfg.n_group_used,
            )
            moe_layers = [l for l in range(cfg.n_layer) if l >= cfg.n_dense]
            if moe_layers:
                if tensors is None:
                    raise ValueError("a MoE model needs its Tensors: routed experts are read on demand")
                mib = DEFAULT_EXPERT_CACHE_MIB if expert_cache is None else expert_cache
                self.experts = ExpertCache(tensors, moe_layers, int(mib * (1 << 20)))
            if cfg.attn_temp_scale and cfg.attn_temp_length <= 0:
                raise ModelError(f"{cfg.path}: attention.temperature_scale set without temperature_length")
        else:
            raise ModelError(f"{cfg.path}: architecture '{cfg.arch}' has no forward pass yet")
        self.rot = rope_rotations(rope, n_ctx, weights.get("rope_freqs"))  # (N, I) complex64
        self.output = weights.get("output", weights["token_embd"])  # (V, D)
        self.numerics = numerics
        self.threads = ThreadPolicy()
        if numerics == "llama.cpp":
            if tensors is None:
                raise ValueError("llama.cpp numerics read the weights as stored: the Model needs its Tensors")
            if cfg.arch == "deepseek2":
                from .mla_reference import GgmlMLA

                ref = GgmlMLA(cfg, tensors, weights, rope, self.kq_scale, self.routing, n_ctx)
            else:
                from .llama_reference import GgmlLlama

                ref = GgmlLlama(cfg, tensors, weights, rope, self.kq_scale, n_ctx)
            self._layer = lambda l, x, pos0: ref.layer(self, l, x, pos0)
            self._logits = ref.logits
        elif numerics != "fast":
            raise ValueError(f"numerics must be 'fast' or 'llama.cpp', not {numerics!r}")

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
        with self.threads.limit(ids.size):
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

    def memory_estimate(self) -> MemoryEstimate:
        """Dense f32 weights + the expert-cache bound + KV bytes per token x context."""
        cfg, all_f32 = self.cfg, 0
        if self.experts is not None:
            per_expert = 3 * cfg.n_ff_exp * cfg.n_embd * 4  # gate, up, down as f32
            all_f32 = per_expert * cfg.n_expert * len(self.experts.layers)
        bound = min(self.experts.capacity, all_f32) if self.experts is not None else 0
        return MemoryEstimate(self.weight_bytes, bound, all_f32, self.cache.record_bytes, self.n_ctx)

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
        return linear(h, self.output)  # (T, V)

    def _llama_layer(self, l: int, x: np.ndarray, pos0: int) -> np.ndarray:
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
        kc, vc = self.cache.a[l], self.cache.b[l]  # (N, G*E) views
        kc[pos0:n] = k.reshape(t, g * e)
        vc[pos0:n] = qkv[:, (h + g) * e :]
        o = gqa_attention(q, kc[:n].reshape(n, g, e), vc[:n].reshape(n, g, e), pos0, self.kq_scale)
        x = x + linear(o, w[b + "attn_output"])  # (T, D)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        return x + swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])

    def _mla_layer(self, l: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """One deepseek2 block (mla-spec 5.2-5.5): MLA over the latent cache (absorbed form, or the
        decompressed one for long prefill chunks), then a dense SwiGLU (leading layers) or routed +
        shared experts."""
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        t, h, c, dn, k = x.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_head
        u = rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        z = linear(u, w[b + "attn_in"])  # (T, Q+C+R) or (T, H*K+C+R)
        nq = z.shape[1] - c - cfg.rope_dim
        if cfg.q_lora_rank:
            q = linear(rms_norm(z[:, :nq], w[b + "attn_q_a_norm"], cfg.rms_eps), w[b + "attn_q_b"])  # (T, H*K)
        else:
            q = z[:, :nq]  # (T, H*K)
        q = q.reshape(t, h, k)  # (T, H, K): per head [nope (Dn) | rope (R)]
        rot = self.rot[pos0 : pos0 + t]  # (T, R/2)
        q_pe = rope_norm(q[:, :, dn:], rot)  # (T, H, R)
        n = pos0 + t
        self.cache.a[l][pos0:n] = rms_norm(z[:, nq : nq + c], w[b + "attn_kv_a_norm"], cfg.rms_eps)  # c
        self.cache.b[l][pos0:n] = rope_norm(z[:, nq + c :], rot)  # k_pe (T, R)
        q_scale = None
        if cfg.attn_temp_scale:  # Mistral-Large-3: 1 + tau * ln(floor(p / length) + 1) per query
            p = np.arange(pos0, n, dtype=np.float64)
            q_scale = (1.0 + cfg.attn_temp_scale * np.log(np.floor(p / cfg.attn_temp_length) + 1.0))
            q_scale = q_scale.astype(np.float32)
        kv = self.cache.records["kv"][:n, l]  # (N, C+R) view of the cache rows [c | k_pe]
        k_b, v_b = w[b + "attn_k_b"], w[b + "attn_v_b"]  # (H, C, Dn), (H, Dv, C)
        # decode and short chunks: absorbed; long prefill chunks: decompressed (faster there)
        form = mla_naive if prefer_naive(t, n, h, c, dn, cfg.v_head_dim) else mla_absorbed
        o = form(q[:, :, :dn], q_pe, kv, k_b, v_b, pos0, self.kq_scale, q_scale)  # (T, H*Dv)
        x = x + linear(o, w[b + "attn_output"])  # (T, D)
        u = rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)  # (T, D)
        if l < cfg.n_dense:
            return x + swiglu(u, w[b + "ffn_gate_up"], w[b + "ffn_down"])
        ids, wts = route(u, w[b + "ffn_gate_inp"], w.get(b + "exp_probs_b"), self.routing)  # (T, K) x2
        out = moe(u, ids, wts, l, self.experts)  # (T, D)
        if b + "ffn_gate_up_shexp" in w:
            out += swiglu(u, w[b + "ffn_gate_up_shexp"], w[b + "ffn_down_shexp"])
        return x + out
