"""Feed-forward blocks: SwiGLU, and the deepseek2 mixture of experts (routing, routed experts kept
quantized and dequantized per expert into a bounded LRU cache, shared experts).

Axis letters: engine/__init__.py (T, D, F; X routed experts, U used per token, Y expert groups).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .ops import linear, silu_mul

NORM_MIN = 6.1035e-5  # llama.cpp clamps the sum of the selected weights here before normalizing


def swiglu(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """W_down (silu(W_gate x) * W_up x). x: (T, D); w_gate_up: (2F, D) = [gate; up]; w_down: (D, F)."""
    f = w_down.shape[1]
    gu = linear(x, w_gate_up)  # (T, 2F)
    h = silu_mul(gu[:, :f], gu[:, f:])  # (T, F)
    return linear(h, w_down)  # (T, D)


@dataclass(frozen=True)
class Routing:
    """How a deepseek2 router picks experts (from the GGUF keys; mla-spec section 5.5)."""

    n_used: int             # U
    gating: int = 1         # 1 softmax, 2 sigmoid
    norm: bool = False      # expert_weights_norm
    scale: float = 0.0      # expert_weights_scale: applied only if not 0 or 1 (newer llama.cpp)
    n_group: int = 0        # expert_group_count: group-limited selection only if > 1
    n_group_used: int = 0


def route(
    x: np.ndarray, w_router: np.ndarray, bias: np.ndarray | None, r: Routing
) -> tuple[np.ndarray, np.ndarray]:
    """Pick U experts per token: ids (T, U) and their weights (T, U), all in float32."""
    logits = linear(x.astype(np.float32, copy=False), w_router)  # (T, X)
    if r.gating == 2:
        probs = 1.0 / (1.0 + np.exp(-logits))  # (T, X)
    else:
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    return select_experts(probs, bias, r)


def select_experts(probs: np.ndarray, bias: np.ndarray | None, r: Routing) -> tuple[np.ndarray, np.ndarray]:
    """From the router probabilities (T, X): the U experts (T, U), best first, and their weights.

    The selection bias (exp_probs_b) only chooses; weights come from the unbiased probabilities.
    As llama.cpp: the weights' sum is taken in double (ggml_sum_rows), then clamped and divided.
    """
    sel = (probs + bias).astype(np.float32) if bias is not None else probs.copy()  # (T, X)
    t, x = sel.shape
    if r.n_group > 1:
        grouped = sel.reshape(t, r.n_group, x // r.n_group)  # (T, Y, X/Y)
        top2 = np.sort(grouped, axis=2)[:, :, -2:]
        score = (top2[:, :, 0] + top2[:, :, 1]).astype(np.float32)  # (T, Y) top-2 sum per group
        drop = np.argsort(-score, axis=1, kind="stable")[:, r.n_group_used :]  # (T, Y - used)
        np.put_along_axis(grouped, drop[:, :, None], -np.inf, axis=1)
    ids = np.argsort(-sel, axis=1, kind="stable")[:, : r.n_used]  # (T, U)
    w = np.take_along_axis(probs, ids, axis=1).astype(np.float32)  # (T, U)
    if r.norm:
        total = np.cumsum(w.astype(np.float64), axis=1)[:, -1:].astype(np.float32)  # (T, 1)
        w = (w / np.maximum(total, np.float32(NORM_MIN))).astype(np.float32)
    if r.scale not in (0.0, 1.0):
        w = (w * np.float32(r.scale)).astype(np.float32)
    return ids, w


class ExpertCache:
    """Routed experts of every MoE layer, dequantized on first use and kept in an LRU bounded in bytes.

    The quantized expert tensors stay in the GGUF memory map; `get(layer, e)` returns the fused
    (gate_up (2F, D), down (D, F)) f32 pair of one expert, dequantizing it on a miss.
    """

    def __init__(self, tensors, layers: list[int], capacity_bytes: int):
        self.tensors = tensors
        self.layers = set(layers)
        self.capacity = int(capacity_bytes)
        self.entries: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        key = (layer, e)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        b, t = f"blk.{layer}.", self.tensors
        if t.has(b + "ffn_gate_up_exps.weight"):
            gate_up = t.f32(b + "ffn_gate_up_exps.weight", expert=e)  # (2F, D)
        else:
            gate_up = np.concatenate(
                [t.f32(b + "ffn_gate_exps.weight", expert=e), t.f32(b + "ffn_up_exps.weight", expert=e)]
            )  # (2F, D)
        down = t.f32(b + "ffn_down_exps.weight", expert=e)  # (D, F)
        size = gate_up.nbytes + down.nbytes
        while self.entries and self.bytes + size > self.capacity:
            _, (g, d) = self.entries.popitem(last=False)
            self.bytes -= g.nbytes + d.nbytes
        if size <= self.capacity:
            self.entries[key] = (gate_up, down)
            self.bytes += size
        return gate_up, down


def moe(x: np.ndarray, ids: np.ndarray, w: np.ndarray, layer: int, experts: ExpertCache) -> np.ndarray:
    """sum_u w[t, u] * expert_{ids[t, u]}(x[t]); tokens grouped by expert (a loop over experts hit only).

    x: (T, D); ids, w: (T, U). Returns (T, D).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # (T*U,)
    order = np.argsort(flat, kind="stable")  # (T*U,) assignments sorted by expert
    hit, starts = np.unique(flat[order], return_index=True)
    ends = np.append(starts[1:], flat.size)
    out = np.zeros_like(x)  # (T, D)
    wf = w.reshape(-1)
    for e, a, b in zip(hit.tolist(), starts.tolist(), ends.tolist(), strict=True):
        sel = order[a:b]  # (M,) assignment indices of expert e
        rows = sel // k  # (M,) token of each assignment; each token picks an expert at most once
        gate_up, down = experts.get(layer, e)
        y = swiglu(x[rows], gate_up, down)  # (M, D)
        y *= wf[sel][:, None]
        out[rows] += y
    return out
