"""deepseek2 with llama.cpp's arithmetic: the same block as deepseek2.Forward.layer, computed with
the ops of ggml_ops.py in the order llama.cpp's graph runs them (`load(..., numerics="llama.cpp")`).

It reads the weights as the GGUF stores them (Q8_0 blocks, F32, ...), fills the same latent cache
(c, k_pe) as the fast path, and reproduces llama.cpp's logits bit for bit
(tests/test_llama_cpp_numerics.py). Scope: split attn_k_b/attn_v_b files whose matmul weights are
of ggml_ops.KINDS (or INT8_KINDS, within their bound). Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import numpy as np

from ....errors import ModelError
from ...cache import KVCache
from ...config import ModelConfig
from ...ffn import select_experts
from ...gguf.tensors import Tensors
from ...ops import causal_mask
from ..deepseek2 import mla_rope, routing
from . import ggml_ops as G

F32 = np.float32


class Forward:
    """The deepseek2 blocks of one Model in llama.cpp's arithmetic (same interface as deepseek2.Forward)."""

    experts = None  # routed experts are read from the GGUF at each use

    def __init__(self, cfg: ModelConfig, weights: dict, tensors: Tensors | None, n_ctx: int,
                 expert_cache_mib: float | None = None):
        if tensors is None:
            raise ValueError("llama.cpp numerics read the weights as stored: the Model needs its Tensors")
        if not cfg.mla_split:
            raise ModelError(f"{cfg.path}: llama.cpp numerics need split attn_k_b/attn_v_b tensors")
        if cfg.attn_temp_scale:
            raise ModelError(f"{cfg.path}: llama.cpp numerics do not cover attention temperature scaling")
        rope, kq_scale = mla_rope(cfg)
        self.cfg, self.t, self.w, self.routing = cfg, tensors, weights, routing(cfg)
        self.kq_scale = F32(kq_scale)
        self.cos, self.sin = G.rope_cache(rope, n_ctx, weights.get("rope_freqs"))  # (P, I) each
        self.mats: dict = {}
        self.output = cfg.output_weight + ".weight"
        G.require_kinds(tensors, [  # now, not at the first prompt: every matmul weight (not the router)
            name for name in tensors.by_name
            if name == self.output or (len(tensors.shape(name)) > 1 and name != "token_embd.weight"
                                       and "ffn_gate_inp" not in name)])

    def _mat(self, name: str, expert: int | None = None, head: int | None = None) -> G.GgmlWeight:
        """Dense weights are kept (views of the mapped file plus their scales); routed experts are
        read again at each use, so memory stays bounded on models with thousands of experts."""
        if expert is not None:
            return G.read_weight(self.t, name, expert, head)
        key = (name, head)
        if key not in self.mats:
            self.mats[key] = G.read_weight(self.t, name, None, head)
        return self.mats[key]

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = G.rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
        return self._mat(self.output)(h)  # (T, V)

    def layer(self, l: int, x: np.ndarray, pos0: int, cache: KVCache) -> np.ndarray:
        cfg, w, b = self.cfg, self.w, f"blk.{l}."
        t, h, c, dn = x.shape[0], cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope
        n = pos0 + t
        u = G.rms_norm(x, w[b + "attn_norm"], cfg.rms_eps)  # (T, D)
        if cfg.q_lora_rank:
            qa = G.rms_norm(self._mat(b + "attn_q_a.weight")(u), w[b + "attn_q_a_norm"], cfg.rms_eps)
            q = self._mat(b + "attn_q_b.weight")(qa)  # (T, H*K)
        else:
            q = self._mat(b + "attn_q.weight")(u)
        q = q.reshape(t, h, cfg.qk_head)  # (T, H, K)
        kv_a = self._mat(b + "attn_kv_a_mqa.weight")(u)  # (T, C+R)
        cos, sin = self.cos[pos0:n], self.sin[pos0:n]
        q_pe = G.rope_norm(q[:, :, dn:], cos, sin)  # (T, H, R)
        cache.a[l][pos0:n] = G.rms_norm(kv_a[:, :c], w[b + "attn_kv_a_norm"], cfg.rms_eps)
        cache.b[l][pos0:n] = G.rope_norm(kv_a[:, c:], cos, sin)
        kv = np.ascontiguousarray(cache.records["kv"][:n, l])  # (N, C+R)
        mask = causal_mask(pos0, t, n)  # (T, N)
        heads = []
        for i in range(h):
            q_nope = np.ascontiguousarray(q[:, i, :dn])  # a permuted view in llama.cpp's graph
            q_abs = self._mat(b + "attn_k_b.weight", head=i)(q_nope, True)  # (T, C)
            q_i = np.concatenate([q_abs, q_pe[:, i]], axis=1)  # (T, C+R) against the shared key [c | k_pe]
            lat = G.attention_head(q_i, kv, kv[:, :c], mask, self.kq_scale)  # (T, C)
            heads.append(self._mat(b + "attn_v_b.weight", head=i)(lat))  # (T, Dv)
        x = (x + self._mat(b + "attn_output.weight")(np.concatenate(heads, axis=1))).astype(F32)
        u = G.rms_norm(x, w[b + "ffn_norm"], cfg.rms_eps)
        if l < cfg.n_dense:
            return (x + self._ffn(u, b + "ffn_gate.weight", b + "ffn_up.weight", b + "ffn_down.weight")).astype(F32)
        return (x + self._moe(u, l)).astype(F32)

    def _ffn(self, x, gate: str, up: str, down: str, expert: int | None = None) -> np.ndarray:
        routed = expert is not None  # ggml_mul_mat_id
        g, u = self._mat(gate, expert)(x, routed), self._mat(up, expert)(x, routed)
        return self._mat(down, expert)(G.silu_mul(g, u), routed)

    def _expert(self, x: np.ndarray, b: str, e: int) -> np.ndarray:
        if self.t.has(b + "ffn_gate_up_exps.weight"):  # merged (X, 2F, D): one matmul, then halves
            gu = self._mat(b + "ffn_gate_up_exps.weight", e)(x, True)  # (T, 2F)
            f = gu.shape[1] // 2
            return self._mat(b + "ffn_down_exps.weight", e)(G.silu_mul(gu[:, :f], gu[:, f:]), True)
        return self._ffn(x, b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight", b + "ffn_down_exps.weight", e)

    def _moe(self, u: np.ndarray, l: int) -> np.ndarray:
        """Routing (build_moe_ffn), experts weighted, summed in selection order, then the shared one."""
        cfg, r, b = self.cfg, self.routing, f"blk.{l}."
        t = u.shape[0]
        logits = G.matmul_f32(u, self.w[b + "ffn_gate_inp"])  # (T, X)
        probs = G.sigmoid(logits) if r.gating == 2 else G.soft_max(logits)
        ids, wts = select_experts(probs, self.w.get(b + "exp_probs_b"), r)  # (T, U) each, best first
        ys = np.zeros((t, r.n_used, u.shape[1]), dtype=F32)  # (T, U, D)
        for e in np.unique(ids).tolist():
            rows, k = np.nonzero(ids == e)
            ys[rows, k] = (self._expert(u[rows], b, e) * wts[rows, k][:, None]).astype(F32)
        out = ys[:, 0]
        for k in range(1, r.n_used):
            out = (out + ys[:, k]).astype(F32)
        if cfg.n_expert_shared:
            shared = self._ffn(u, b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight", b + "ffn_down_shexp.weight")
            out = (out + shared).astype(F32)
        return out
