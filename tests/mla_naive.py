"""A naive float64 deepseek2 written from the spec alone, and the engine built from the same file.

`naive_logits` reads a GGUF with gguf-py directly (nothing from colichat) and runs the decompressed
multi-head form of mla-spec 5.3: every cached latent expanded to per-head k_nope and v, RoPE from the
formula of 4.3 per position, the kq_scale of 4.4, routing of 5.5 with a loop per token.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from colichat.engine.architectures import load_config
from colichat.engine.gguf.tensors import Tensors, open_gguf
from colichat.engine.model import Model, prepare_weights


def _meta(reader, arch):
    def key(k, default=None):
        f = reader.fields.get(f"{arch}.{k}")
        return default if f is None else f.contents()

    return key


def read_tensors(reader) -> dict[str, np.ndarray]:
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        out[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)
    return out


def rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x) + eps) * g


def rope(x, p, n_dims, base, factor, orig, yarn):
    """NORM pairs (2i, 2i+1) rotated by the YaRN-blended angle; magnitude 1 (mla-spec 4.3, 4.4)."""
    out = x.copy()
    for i in range(n_dims // 2):
        theta_ex = p * base ** (-2.0 * i / n_dims)
        theta = theta_ex / factor
        if yarn:
            def corr(beta):
                return n_dims * math.log(orig / (2 * math.pi * beta)) / (2 * math.log(base))

            low, high = max(0.0, math.floor(corr(32.0))), min(n_dims - 1.0, math.ceil(corr(1.0)))
            ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
            theta = theta * (1 - ramp) + theta_ex * ramp
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * math.cos(theta) - b * math.sin(theta)
        out[..., 2 * i + 1] = a * math.sin(theta) + b * math.cos(theta)
    return out


def _swiglu(x, gate, up, down):
    g = gate @ x
    return down @ (g / (1 + np.exp(-g)) * (up @ x))


def naive_logits(path, ids) -> np.ndarray:
    """Logits (T, V) of every position, float64, decompressed attention, one token at a time."""
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    key = _meta(reader, arch)
    W = read_tensors(reader)
    L, H = key("block_count"), key("attention.head_count")
    C, R = key("attention.kv_lora_rank"), key("rope.dimension_count")
    dqk = key("attention.key_length_mla") or key("attention.key_length")
    dv = key("attention.value_length_mla") or key("attention.value_length")
    dn, eps = dqk - R, key("attention.layer_norm_rms_epsilon")
    base = key("rope.freq_base", 10000.0)
    yarn = key("rope.scaling.type") == "yarn"
    factor = key("rope.scaling.factor", 1.0) if yarn else 1.0
    orig = key("rope.scaling.original_context_length", key("context_length"))
    mscale = 1.0 + key("rope.scaling.yarn_log_multiplier", 0.0) * math.log(factor)
    kq_scale = mscale * mscale / math.sqrt(dqk)
    tau, tlen = key("attention.temperature_scale", 0.0), key("attention.temperature_length", 1)
    n_dense = key("leading_dense_block_count", 0)
    E, K = key("expert_count", 0), key("expert_used_count", 0)
    gating, norm = key("expert_gating_func", 1), key("expert_weights_norm", False)
    scale, n_group, n_group_used = key("expert_weights_scale", 0.0), key("expert_group_count", 0), key(
        "expert_group_used_count", 0
    )
    out_w = W.get("output.weight", W["token_embd.weight"])
    cache = [[] for _ in range(L)]  # per layer: list of (k (H, dqk), v (H, dv)) decompressed
    logits = []
    for p, tok in enumerate(ids):
        x = W["token_embd.weight"][tok].copy()
        for l in range(L):
            b = f"blk.{l}."
            u = rms(x, W[b + "attn_norm.weight"], eps)
            if b + "attn_q.weight" in W:
                q = W[b + "attn_q.weight"] @ u
            else:
                q = W[b + "attn_q_b.weight"] @ rms(W[b + "attn_q_a.weight"] @ u, W[b + "attn_q_a_norm.weight"], eps)
            q = q.reshape(H, dqk)
            q[:, dn:] = rope(q[:, dn:], p, R, base, factor, orig, yarn)
            z = W[b + "attn_kv_a_mqa.weight"] @ u
            c = rms(z[:C], W[b + "attn_kv_a_norm.weight"], eps)
            k_pe = rope(z[C:], p, R, base, factor, orig, yarn)
            if b + "attn_kv_b.weight" in W:
                w3 = W[b + "attn_kv_b.weight"].reshape(H, dn + dv, C)
                w_uk, w_uv = w3[:, :dn], w3[:, dn:]
            else:
                w_uk, w_uv = W[b + "attn_k_b.weight"].transpose(0, 2, 1), W[b + "attn_v_b.weight"]
            k = np.concatenate([np.einsum("hnc,c->hn", w_uk, c), np.tile(k_pe, (H, 1))], axis=1)
            cache[l].append((k, np.einsum("hvc,c->hv", w_uv, c)))
            if tau:
                q = q * (1.0 + tau * math.log(math.floor(p / tlen) + 1.0))
            o = np.zeros((H, dv))
            for h in range(H):
                s = np.array([q[h] @ kk[h] for kk, _ in cache[l]]) * kq_scale
                pr = np.exp(s - s.max())
                pr /= pr.sum()
                o[h] = sum(pj * vv[h] for pj, (_, vv) in zip(pr, cache[l], strict=True))
            x = x + W[b + "attn_output.weight"] @ o.reshape(-1)
            v = rms(x, W[b + "ffn_norm.weight"], eps)
            if l < n_dense:
                x = x + _swiglu(v, W[b + "ffn_gate.weight"], W[b + "ffn_up.weight"], W[b + "ffn_down.weight"])
                continue
            lg = W[b + "ffn_gate_inp.weight"] @ v
            prob = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum() if gating == 1 else 1 / (1 + np.exp(-lg))
            sel = prob + W.get(b + "exp_probs_b.bias", 0.0)
            if n_group > 1:
                groups = sel.reshape(n_group, -1)
                gscore = [sorted(g)[-2:] for g in groups]
                keep = sorted(range(n_group), key=lambda j: -sum(gscore[j]))[:n_group_used]
                sel = np.array([s if e // groups.shape[1] in keep else -np.inf for e, s in enumerate(sel)])
            chosen = sorted(range(E), key=lambda e: -sel[e])[:K]
            wts = np.array([prob[e] for e in chosen])
            if norm:
                wts = wts / max(wts.sum(), 6.1035e-5)
            if scale not in (0.0, 1.0):
                wts = wts * scale
            for e, we in zip(chosen, wts, strict=True):
                ffn = [W[b + f"ffn_{n}_exps.weight"][e] for n in ("gate", "up", "down")]
                x = x + we * _swiglu(v, *ffn)
            if b + "ffn_gate_shexp.weight" in W:
                x = x + _swiglu(v, *[W[b + f"ffn_{n}_shexp.weight"] for n in ("gate", "up", "down")])
        logits.append(out_w @ rms(x, W["output_norm.weight"], eps))
    return np.array(logits)


def engine(path, n_ctx=256, expert_cache=None) -> Model:
    reader = open_gguf(str(path))
    tensors = Tensors(reader, str(path))
    cfg = load_config(reader, str(path), tensors)
    return Model(cfg, prepare_weights(cfg, tensors), None, n_ctx, tensors, expert_cache=expert_cache)
