"""Sparse-attention MLA (deepseek32, glm-dsa) and MTP blocks: agreement with llama.cpp on the tiny
reference models, the Ic cache rows, decode vs chunked prefill, what decode reads and computes,
configuration and bad files, and the MTP block. docs/dsa-mtp-spec.md has the math.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2

import colichat.engine as engine
import colichat.engine.architectures.deepseek2 as deepseek2
import colichat.engine.attention as attention
import colichat.engine.model as model_mod
from colichat.engine import indexer as I
from colichat.engine import load
from colichat.engine.architectures import dsa
from colichat.engine.architectures.dsa import glm_5_2_types, index_slots
from colichat.engine.cache import record_bytes
from colichat.engine.gguf.tensors import Tensors, open_gguf
from colichat.engine.model import working_bytes
from colichat.engine.mtp import MTPBlock
from colichat.errors import ModelError

DSA_MODELS = ["ds-v32", "glm-dsa"]


@pytest.fixture(scope="module")
def models():
    return {}


def tiny(models, name):
    if name not in models:
        models[name] = load(str(TINY / f"{name}.gguf"), n_ctx=512)
    m = models[name]
    m.reset()
    return m


# --- agreement with llama.cpp ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["ref", "long.ref"])
@pytest.mark.parametrize("name", DSA_MODELS)
def test_tiny_dsa_matches_llama_cpp(models, name, case):
    """Every position: same argmax, max |diff| < 1e-3 (measured: < 1e-5). The long case (320
    tokens, K = 8 / 12) drops keys: without the selection the logits are far off."""
    ref = np.load(TINY / f"{name}.{case}.npz")
    m = tiny(models, name)
    logits = m.prefill(ref["tokens_0"])
    assert logits.shape == ref["logits_0"].shape
    assert np.abs(logits - ref["logits_0"]).max() < 1e-3
    assert np.array_equal(logits.argmax(1), ref["logits_0"].argmax(1))
    if case == "long.ref":
        m.fwd.sparse = False  # dense attention over every cached key
        try:
            m.reset()
            dense = m.prefill(ref["tokens_0"])
        finally:
            m.fwd.sparse = True
        assert np.abs(dense - ref["logits_0"]).max() > 0.5


@pytest.mark.parametrize("name", DSA_MODELS)
def test_top_k_selection_has_no_near_tie_on_the_references(models, name, monkeypatch):
    """The margin that makes the agreement robust: at every query with more than K causal keys,
    the K-th and (K+1)-th indexer scores differ by far more than float32 rounding of a score
    (~1e-6 here). Measured smallest gaps: ds-v32 7.3e-5 (scores ~1.1), glm-dsa 1.2e-4."""
    gaps = []
    real = I.top_k_mask

    def spy(scores, k):
        for row in scores:
            f = np.sort(row[np.isfinite(row)])[::-1]
            if f.size > k:
                gaps.append(float(f[k - 1] - f[k]))
        return real(scores, k)

    monkeypatch.setattr(I, "top_k_mask", spy)
    tiny(models, name).prefill(np.load(TINY / f"{name}.long.ref.npz")["tokens_0"])
    assert len(gaps) > 500 and min(gaps) > 5e-5


# --- the cache, decode, chunking --------------------------------------------------------------------------


def test_cache_records_carry_ic_rows(models):
    """record = token, every layer's c|k_pe, then Di floats per full-indexer layer."""
    m = tiny(models, "ds-v32")
    assert m.cache.record.names == ("token", "kv", "ic")
    assert (m.cache.index_hd, m.cache.n_index_layers) == (64, 3)
    assert m.cache.record_bytes == 4 + 4 * (3 * (128 + 16) + 3 * 64) == 2500
    g = tiny(models, "glm-dsa")
    assert g.cfg.index_types == (1, 0, 1, 0) and index_slots(g.cfg) == [0, -1, 1, -1]
    assert (g.cache.n_layer, g.cache.n_index_layers, g.cache.record_bytes) == (4, 2, 4 + 4 * (4 * 144 + 2 * 64))
    assert g.cache.kv_bytes_per_token == g.cache.record_bytes - 4


def test_memory_check_counts_the_ic_rows(models, monkeypatch):
    """load() refuses a context whose cache, Ic rows included, does not fit beside the weights."""
    path = str(TINY / "ds-v32.gguf")
    record = tiny(models, "ds-v32").cache.record_bytes  # 2500 bytes, of which 3 x 64 x 4 = 768 are Ic rows
    assert record == record_bytes(3, 128, 16, 64, 3)
    dense = engine.dense_f32_bytes(Tensors(open_gguf(path), path)) + working_bytes(tiny(models, "ds-v32").cfg)
    monkeypatch.setattr(engine, "available_memory", lambda: dense + record * 512 - 1)
    with pytest.raises(ModelError, match="use at most 511 tokens"):
        load(path, n_ctx=512)
    monkeypatch.setattr(engine, "available_memory", lambda: dense + record * 512)
    assert load(path, n_ctx=512).cache.record_bytes == record


@pytest.mark.parametrize("name", DSA_MODELS)
def test_chunked_prefill_equals_token_by_token_decode(models, name, monkeypatch):
    ids = np.load(TINY / f"{name}.long.ref.npz")["tokens_0"][:150]
    m = tiny(models, name)
    whole = m.prefill(ids)
    rec = m.cache.records[: ids.size].copy()
    m.reset()
    parts = np.concatenate([m.prefill(ids[:3]), m.prefill(ids[3:40]), m.prefill(ids[40:])])
    parts_rec = m.cache.records[: ids.size].copy()
    m.reset()
    steps = np.stack([m.decode(int(i)) for i in ids])
    assert np.abs(parts - whole).max() < 1e-4 and np.abs(steps - whole).max() < 1e-4
    for got in (parts_rec, m.cache.records[: ids.size]):
        assert np.array_equal(got["token"], rec["token"])
        assert np.abs(got["kv"] - rec["kv"]).max() < 1e-5 and np.abs(got["ic"] - rec["ic"]).max() < 1e-5
    # the query blocks of attention and of the indexer scores give the same numbers
    monkeypatch.setattr(model_mod, "PREFILL_CHUNK", 32)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 7)
    monkeypatch.setattr(I, "SCORE_BUDGET", 5000)
    m.reset()
    assert np.abs(m.prefill(ids) - whole).max() < 1e-4


def test_absorbed_and_decompressed_forms_agree_with_a_selection(models, monkeypatch):
    ids = np.load(TINY / "ds-v32.long.ref.npz")["tokens_0"][:200]
    m = tiny(models, "ds-v32")
    out = {}
    for naive in (False, True):
        monkeypatch.setattr(deepseek2, "prefer_naive", lambda *a, naive=naive: naive)
        m.reset()
        out[naive] = np.concatenate([m.prefill(ids[:90]), m.prefill(ids[90:])])
    assert np.abs(out[True] - out[False]).max() < 1e-4


@pytest.mark.parametrize("name", DSA_MODELS)
def test_decode_reads_cached_ic_and_attends_to_k_keys(models, name, monkeypatch):
    """Decode computes the indexer key of the new token only, scores it against the cached Ic
    rows (one pass over N keys), and attention reads the K gathered rows, not N."""
    ids = np.load(TINY / f"{name}.long.ref.npz")["tokens_0"][:100]
    m = tiny(models, name)
    m.prefill(ids[:-1])
    keys_rows, score_keys, attn_rows = [], [], []
    real_keys, real_scores, real_attn = I.indexer_keys, I.indexer_scores, deepseek2.mla_absorbed
    monkeypatch.setattr(I, "indexer_keys", lambda x, *a: keys_rows.append(x.shape[0]) or real_keys(x, *a))
    monkeypatch.setattr(I, "indexer_scores",
                        lambda q, w, k, p: score_keys.append((q.shape[0], k.shape[0])) or real_scores(q, w, k, p))
    monkeypatch.setattr(deepseek2, "mla_absorbed",
                        lambda qn, qp, kv, *a: attn_rows.append(kv.shape[0]) or real_attn(qn, qp, kv, *a))
    want = m.decode(int(ids[-1]))
    nic, k = m.cfg.n_index_layers, m.cfg.index_top_k
    assert keys_rows == [1] * nic and score_keys == [(1, 100)] * nic
    assert attn_rows == [k] * m.cfg.n_layer
    # the cached rows are what decode reads: other Ic rows, other selection, other logits
    m.cache.truncate(99)
    for j in range(nic):
        m.cache.ic[j][:99] = np.random.default_rng(j).standard_normal((99, m.cfg.index_head_dim))
    assert np.abs(m.decode(int(ids[-1])) - want).max() > 1e-3


def test_shared_indexer_layers_reuse_the_previous_selection(models, monkeypatch):
    m = tiny(models, "glm-dsa")
    seen = []
    real = dsa.Forward.select

    def spy(self, l, *a):
        keep = real(self, l, *a)
        seen.append((l, keep))
        return keep

    monkeypatch.setattr(dsa.Forward, "select", spy)
    m.prefill(np.arange(40) % 200)
    assert [l for l, _ in seen] == [0, 1, 2, 3]
    assert seen[1][1] is seen[0][1] and seen[3][1] is seen[2][1] and seen[2][1] is not seen[0][1]
    assert seen[0][1].sum(axis=1).max() == m.cfg.index_top_k  # 40 tokens > K = 12: keys dropped


# --- configuration, bad files --------------------------------------------------------------------------


def dsa_spec(arch="deepseek32", **kw):
    return DS2Spec(arch=arch, index_heads=8, index_dim=16, index_top_k=5, **kw)


def test_glm_dsa_indexer_types_defaults(tmp_path):
    assert glm_5_2_types(78).count(1) == 2 + 19 and glm_5_2_types(78)[:8] == (1, 1, 1, 0, 0, 0, 1, 0)
    short = load(str(write_deepseek2(tmp_path / "a.gguf", dsa_spec("glm-dsa", n_layer=6))), n_ctx=32)
    assert short.cfg.index_types == (1,) * 6 and not short.cfg.index_neox and short.cfg.index_eps == 0.0
    long_ctx = write_deepseek2(tmp_path / "b.gguf", dsa_spec("glm-dsa", n_layer=6, context_length=1 << 20))
    m = load(str(long_ctx), n_ctx=32)
    assert m.cfg.index_types == (1, 1, 1, 0, 0, 0) and m.cache.n_index_layers == 3
    ds = load(str(write_deepseek2(tmp_path / "c.gguf", dsa_spec())), n_ctx=32)
    assert ds.cfg.index_types == (1, 1, 1) and ds.cfg.index_neox and ds.cfg.index_eps == 1e-6


@pytest.mark.parametrize("spec,words", [
    (dsa_spec(drop=("blk.1.indexer.proj.weight",)), "missing tensor 'blk.1.indexer.proj.weight'"),
    (dsa_spec(reshape={"blk.0.indexer.attn_k.weight": (15, 64)}), "'blk.0.indexer.attn_k.weight' has shape"),
    (dsa_spec("glm-dsa", index_types=(0, 1, 1)), "first layer must own a full indexer"),
    (dsa_spec("glm-dsa", index_types=(1, 2, 1)), "indexer.types must hold 0/1"),
    (dsa_spec(q_lora_rank=0), "needs the q latent"),
    (dsa_spec(n_nextn=1, reshape={"blk.3.nextn.eh_proj.weight": (64, 64)}), "'blk.3.nextn.eh_proj.weight' has shape"),
    (dsa_spec(extra_keys={"deepseek32.attention.indexer.top_k": 0}), "top_k 0 must be positive"),
])
def test_bad_dsa_files_are_refused_with_one_line(tmp_path, spec, words):
    path = write_deepseek2(tmp_path / "bad.gguf", spec)
    with pytest.raises(ModelError) as e:
        load(str(path), n_ctx=32)
    assert words in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


# --- MTP blocks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,l", [("glm-dsa", 4), ("ds-v3-mtp", 3)])
def test_mtp_weights_are_checked_and_kept(models, name, l):
    m = tiny(models, name)
    assert m.cfg.n_nextn == 1 and m.cfg.n_layer == l and m.cache.n_layer == l
    b = f"blk.{l}."
    assert m.w[b + "nextn.eh_proj"].shape == (256, 512)
    for s in ("enorm", "hnorm", "shared_head_norm"):
        assert m.w[b + "nextn." + s].shape == (256,)
    assert m.w[b + "nextn.shared_head_head"].shape == (268, 256)
    assert b + "attn_in" in m.w and b + "attn_k_b" in m.w and b + "ffn_gate_inp" in m.w
    assert not any(k.startswith(b + "indexer.") for k in m.w)  # the MTP block has no indexer
    assert l in m.experts.layers  # its routed experts are read like the trunk's


@pytest.mark.parametrize("name", ["glm-dsa", "ds-v3-mtp"])
def test_mtp_block_drafts_from_the_trunk_hidden_states(models, name):
    """The spec's feeding: MTP position q gets (h_{q-1}, x_q), h_{-1} = 0; row q of its logits is
    the draft of x_{q+1}. One pass over a prompt equals position-by-position feeding; the block's
    latent rows live in its own cache, the trunk cache is untouched."""
    ids = np.load(TINY / f"{name}.ref.npz")["tokens_0"]
    m = tiny(models, name)
    logits, h = m.prefill(ids, hidden=True)  # (T, V), (T, D)
    assert h.shape == (ids.size, 256)
    trunk = m.cache.records[: ids.size].copy()
    mtp = MTPBlock(m)
    h_prev = np.concatenate([np.zeros((1, 256), np.float32), h[:-1]])
    drafts = mtp.forward(h_prev, ids)  # (T, V)
    assert drafts.shape == (ids.size, 268) and np.isfinite(drafts).all()
    assert mtp.cache.length == ids.size and mtp.cache.n_layer == 1
    assert m.cache.records[: ids.size].tobytes() == trunk.tobytes()
    mtp.reset()
    steps = np.concatenate([mtp.forward(h_prev[i : i + 1], ids[i : i + 1]) for i in range(ids.size)])
    assert np.abs(steps - drafts).max() < 1e-4
    mtp.truncate(10)
    assert np.abs(mtp.forward(h_prev[10:], ids[10:]) - drafts[10:]).max() < 1e-4
    # the draft depends on the trunk state: another hidden state, another draft
    mtp.truncate(10)
    assert np.abs(mtp.forward(h_prev[10:] * 0, ids[10:]) - drafts[10:]).max() > 1e-2
    # the trunk's hidden state is output_norm of what the logits come from
    assert np.abs(h @ m.output.T - logits).max() < 1e-4
