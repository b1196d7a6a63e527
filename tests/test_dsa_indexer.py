"""The lightning indexer's array functions (colichat/engine/indexer.py) and sparse MLA attention
against a float64 reference written here from docs/dsa-mtp-spec.md, one token and one head at a time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from colichat.engine import indexer as I
from colichat.engine.attention import mla_absorbed, mla_naive
from colichat.engine.rope import RopeParams, rope_rotations

RNG = np.random.default_rng(7)


def ref_rope_prefix(v, p, r, base, neox):
    """Rotate the first r dims of vector v at position p; theta_i = p * base^(-2i/r)."""
    out = v.astype(np.float64).copy()
    for i in range(r // 2):
        th = p * base ** (-2.0 * i / r)
        a, b = (i, i + r // 2) if neox else (2 * i, 2 * i + 1)
        out[a] = v[a] * math.cos(th) - v[b] * math.sin(th)
        out[b] = v[a] * math.sin(th) + v[b] * math.cos(th)
    return out


def ref_layer_norm(v, g, b, eps):
    v = v.astype(np.float64)
    return (v - v.mean()) / math.sqrt(v.var() + eps) * g + b


def ref_scores(x, qr, W, p_all, r, base, neox, eps):
    """score[t][s] for every token t over tokens s <= t (float64, loops)."""
    hi, di = W["proj"].shape[0], W["attn_k"].shape[0]
    keys = [ref_rope_prefix(ref_layer_norm(W["attn_k"] @ x[s], W["k_norm"], W["k_norm_b"], eps), p_all[s], r, base,
                            neox) for s in range(len(x))]
    out = []
    for t in range(len(x)):
        q = (W["attn_q_b"] @ qr[t]).reshape(hi, di)
        q = np.stack([ref_rope_prefix(q[h], p_all[t], r, base, neox) for h in range(hi)])
        w = W["proj"] @ x[t] / math.sqrt(di * hi)
        out.append([sum(w[h] * max(0.0, float(q[h] @ keys[s])) for h in range(hi)) for s in range(t + 1)])
    return out, np.array(keys)


def ref_top_k(scores_row, k):
    order = sorted(range(len(scores_row)), key=lambda s: (-scores_row[s], s))
    return sorted(order[:k])


def weights(d, q, hi, di):
    return {
        "attn_k": RNG.standard_normal((di, d)) / math.sqrt(d),
        "k_norm": 1 + 0.1 * RNG.standard_normal(di),
        "k_norm_b": 0.1 * RNG.standard_normal(di),
        "attn_q_b": RNG.standard_normal((hi * di, q)) / math.sqrt(q),
        "proj": RNG.standard_normal((hi, d)) / math.sqrt(d),
    }


@pytest.mark.parametrize("neox", [True, False])
def test_indexer_keys_scores_and_selection_match_the_float64_reference(neox):
    d, q, hi, di, r, n, k, eps = 32, 24, 8, 16, 8, 30, 6, 1e-6
    W = weights(d, q, hi, di)
    x, qr = RNG.standard_normal((n, d)), RNG.standard_normal((n, q))
    ref, ref_keys = ref_scores(x, qr, W, list(range(n)), r, 10000.0, neox, eps)
    rot = rope_rotations(RopeParams(n_dims=r, base=10000.0), n)  # (N, R/2)
    f = {kk: v.astype(np.float32) for kk, v in W.items()}
    x32, qr32 = x.astype(np.float32), qr.astype(np.float32)
    keys = I.indexer_keys(x32, f["attn_k"], f["k_norm"], f["k_norm_b"], eps, rot, neox)  # (N, Di)
    assert np.abs(keys - ref_keys).max() < 1e-5
    assert np.array_equal(keys[:, r:], I.layer_norm(x32 @ f["attn_k"].T, f["k_norm"], f["k_norm_b"], eps)[:, r:])
    qi = I.indexer_queries(qr32, f["attn_q_b"], hi, rot, neox)  # (N, Hi, Di)
    w = I.indexer_head_weights(x32, f["proj"], di)  # (N, Hi)
    # all at once, and in two chunks over the same cache (the chunked prefill / decode path)
    s_all = I.indexer_scores(qi, w, keys, 0)
    s_parts = np.full((n, n), -np.inf, dtype=np.float32)
    s_parts[:11, :11] = I.indexer_scores(qi[:11], w[:11], keys[:11], 0)
    s_parts[11:] = I.indexer_scores(qi[11:], w[11:], keys, 11)
    for s in (s_all, s_parts):
        for t in range(n):
            assert np.allclose(s[t, : t + 1], ref[t], atol=1e-5)
            assert np.all(s[t, t + 1 :] == -np.inf)
    keep = I.top_k_mask(s_all, k)
    for t in range(n):
        assert np.flatnonzero(keep[t]).tolist() == ref_top_k(ref[t], k)
    assert I.top_k_positions(s_all[n - 1], k).tolist() == ref_top_k(ref[n - 1], k)


def test_scores_are_computed_in_query_blocks(monkeypatch):
    d, q, hi, di, n = 16, 8, 4, 8, 40
    W = {kk: v.astype(np.float32) for kk, v in weights(d, q, hi, di).items()}
    x, qr = RNG.standard_normal((n, d)).astype(np.float32), RNG.standard_normal((n, q)).astype(np.float32)
    rot = rope_rotations(RopeParams(n_dims=4, base=10000.0), n)
    keys = I.indexer_keys(x, W["attn_k"], W["k_norm"], W["k_norm_b"], 0.0, rot, False)
    qi, w = I.indexer_queries(qr, W["attn_q_b"], hi, rot, False), I.indexer_head_weights(x, W["proj"], di)
    whole = I.indexer_scores(qi, w, keys, 0)
    monkeypatch.setattr(I, "SCORE_BUDGET", 3 * hi * n)
    np.testing.assert_allclose(I.indexer_scores(qi, w, keys, 0), whole, rtol=0, atol=1e-6)


def test_ties_go_to_the_lower_position():
    s = np.array([[1.0, 0.0, 2.0, 0.0, 0.0, 0.0, -np.inf]], dtype=np.float32)
    assert np.flatnonzero(I.top_k_mask(s, 3)[0]).tolist() == [0, 1, 2]
    assert np.flatnonzero(I.top_k_mask(s, 4)[0]).tolist() == [0, 1, 2, 3]
    # every key scores 0 (all products negative): the first k positions
    z = np.zeros((1, 9), dtype=np.float32)
    assert np.flatnonzero(I.top_k_mask(z, 4)[0]).tolist() == [0, 1, 2, 3]
    # fewer causal keys than k: all of them, never a masked one
    c = np.array([[0.5, 0.1, -np.inf, -np.inf]], dtype=np.float32)
    assert I.top_k_mask(c, 3)[0].tolist() == [True, True, False, False]


def ref_sparse_mla(q_nope, q_pe, kv, k_b, v_b, pos0, scale, sel):
    """Decompressed per-head attention over the selected positions only (float64)."""
    t, h, _ = q_nope.shape
    c = k_b.shape[1]
    out = np.zeros((t, h, v_b.shape[1]))
    for i in range(t):
        idx = [s for s in sel[i] if s <= pos0 + i]
        for hh in range(h):
            k_nope = kv[idx, :c] @ k_b[hh]  # (n, Dn)
            logits = (k_nope @ q_nope[i, hh] + kv[idx, c:] @ q_pe[i, hh]) * scale
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[i, hh] = v_b[hh] @ (p @ kv[idx, :c])
    return out.reshape(t, -1)


@pytest.mark.parametrize("form", [mla_absorbed, mla_naive])
def test_sparse_mla_attention_uses_only_the_selected_keys(form):
    t, pos0, h, c, r, dn, dv, k = 9, 14, 3, 16, 4, 8, 6, 5
    n = pos0 + t
    q_nope = RNG.standard_normal((t, h, dn)).astype(np.float32)
    q_pe = RNG.standard_normal((t, h, r)).astype(np.float32)
    kv = RNG.standard_normal((n, c + r)).astype(np.float32)
    k_b = (RNG.standard_normal((h, c, dn)) / 4).astype(np.float32)
    v_b = (RNG.standard_normal((h, dv, c)) / 4).astype(np.float32)
    scores = RNG.standard_normal((t, n)).astype(np.float32)
    scores[np.arange(n)[None, :] > np.arange(pos0, n)[:, None]] = -np.inf
    keep = I.top_k_mask(scores, k)
    sel = [np.flatnonzero(row).tolist() for row in keep]
    want = ref_sparse_mla(q_nope, q_pe, kv.astype(np.float64), k_b, v_b, pos0, 0.3, sel)
    got = form(q_nope, q_pe, kv, k_b, v_b, pos0, 0.3, mask=I.selection_mask(keep))
    assert np.abs(got - want).max() < 1e-5
    # one query (decode): the mask form equals attention over the gathered selected rows
    last = sel[-1]
    one = form(q_nope[-1:], q_pe[-1:], kv, k_b, v_b, n - 1, 0.3, mask=I.selection_mask(keep[-1:]))
    gathered = form(q_nope[-1:], q_pe[-1:], kv[last], k_b, v_b, len(last) - 1, 0.3)
    assert np.abs(one - want[-1:]).max() < 1e-5 and np.abs(gathered - one).max() < 1e-5
