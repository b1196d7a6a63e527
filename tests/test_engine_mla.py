"""The MLA engine (deepseek2, and plm and minicpm3 on its pieces): agreement with llama.cpp on the
tiny reference models, chunking, file variants (split/legacy, q_lora/lite, quant types), routing
rules, expert cache, refusals, bad files.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2
from mla_naive import engine, naive_logits

import colichat.engine.architectures.deepseek2 as deepseek2_mod
import colichat.engine.attention as attention
import colichat.engine.model as model_mod
from colichat.engine import load
from colichat.engine.architectures import load_config
from colichat.engine.architectures.deepseek2 import mla_rope
from colichat.engine.ffn import Routing, route
from colichat.engine.gguf.tensors import Tensors, open_gguf
from colichat.errors import ModelError

F32_MODELS = ["ds-v3", "ds-v2-lite", "ds-dense", "plm", "minicpm3"]
# The context size llama.cpp made a reference with, where it matters: minicpm3's LongRoPE factors
# are the short ones up to the original context (256), the long ones past it.
REF_CTX = {("minicpm3", "ref"): 256, ("minicpm3", "long.ref"): 1024}


@pytest.fixture(scope="module")
def models():
    return {}


def tiny(models, name, n_ctx=512):
    if (name, n_ctx) not in models:
        models[name, n_ctx] = load(str(TINY / f"{name}.gguf"), n_ctx=n_ctx)
    m = models[name, n_ctx]
    m.reset()
    return m


# --- agreement with llama.cpp ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["ref", "long.ref"])
@pytest.mark.parametrize("name", F32_MODELS)
def test_tiny_f32_matches_llama_cpp(models, name, case):
    """f32 files: an exact f32 implementation is ~1e-5 from llama.cpp; the long case (320 tokens)
    runs ds-v3 past its YaRN original context (256). plm: legacy attn_kv_b without q_lora,
    squared-ReLU FFN, tied output; minicpm3: q_lora, LongRoPE (short factors at context 256, long
    ones at 1024), NEOX RoPE, scaled embeddings, residuals and logits."""
    ref = np.load(TINY / f"{name}.{case}.npz")
    logits = tiny(models, name, REF_CTX.get((name, case), 512)).prefill(ref["tokens_0"])
    assert logits.shape == ref["logits_0"].shape
    assert np.abs(logits - ref["logits_0"]).max() < 2e-3
    assert np.array_equal(logits.argmax(1), ref["logits_0"].argmax(1))


@pytest.mark.parametrize("case", ["ref", "long.ref"])
def test_tiny_q8_0_matches_llama_cpp(models, case):
    """llama.cpp multiplies Q8_0 weights with activations rounded to Q8_0, we with f32 activations:
    logits differ by ~0.05 everywhere. Where that noise flips a near-tie of the MoE router (selection
    margins below ~0.005), the chosen experts differ and so do the logits (by up to ~2.6 at 17 of the
    320 positions of the long case). So: argmax at >= 90% of positions everywhere, max difference
    < 0.25 on the 40-token case, and at >= 90% of the positions of the 320-token case. The llama.cpp
    numerics give llama.cpp's logits exactly (test_llama_cpp_numerics.py)."""
    ref = np.load(TINY / f"ds-v3.q8_0.{case}.npz")
    logits = tiny(models, "ds-v3.q8_0").prefill(ref["tokens_0"])
    diff = np.abs(logits - ref["logits_0"]).max(axis=1)
    assert np.mean(logits.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9
    if case == "ref":
        assert diff.max() < 0.25
    else:
        assert np.mean(diff < 0.25) >= 0.9
        assert np.median(diff) < 0.1


# --- chunking, cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ds-v3", "plm", "minicpm3"])
def test_one_chunk_equals_chunks_equals_decode(models, monkeypatch, name):
    ids = np.load(TINY / f"{name}.long.ref.npz")["tokens_0"][:120]
    m = tiny(models, name)
    whole = m.prefill(ids)
    whole_kv = m.cache.records[: ids.size].copy()
    m.reset()
    parts = np.concatenate([m.prefill(ids[:7]), m.prefill(ids[7:70]), m.prefill(ids[70:])])
    parts_kv = m.cache.records[: ids.size].copy()
    m.reset()
    steps = np.stack([m.decode(int(i)) for i in ids])
    assert np.abs(parts - whole).max() < 1e-4 and np.abs(steps - whole).max() < 1e-4
    assert np.abs(m.cache.records[: ids.size]["kv"] - whole_kv["kv"]).max() < 1e-5
    assert np.abs(parts_kv["kv"] - whole_kv["kv"]).max() < 1e-5
    assert m.cache.token_ids() == ids.tolist()
    # prefill's own chunking and attention's query blocks give the same numbers
    monkeypatch.setattr(model_mod, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    m.reset()
    assert np.abs(m.prefill(ids) - whole).max() < 1e-4
    monkeypatch.setattr(attention, "SCORE_BUDGET", 300)
    m.reset()
    assert np.abs(m.prefill(ids) - whole).max() < 1e-4


@pytest.mark.parametrize("name", ["ds-v3", "ds-v2-lite", "plm", "minicpm3"])
def test_absorbed_and_decompressed_prefill_agree(models, monkeypatch, name):
    """Prefill picks the decompressed form for long chunks, the absorbed one otherwise: forcing
    either gives the same logits and the same cache (c and k_pe are computed before attention)."""
    ids = np.load(TINY / f"{name}.long.ref.npz")["tokens_0"][:200]
    m = tiny(models, name)
    out = {}
    for naive in (False, True):
        monkeypatch.setattr(deepseek2_mod, "prefer_naive", lambda *a, naive=naive: naive)
        m.reset()
        out[naive] = (np.concatenate([m.prefill(ids[:90]), m.prefill(ids[90:])]), m.cache.records[:200].copy())
    assert np.abs(out[True][0] - out[False][0]).max() < 1e-4
    kv_naive, kv_absorbed = out[True][1]["kv"], out[False][1]["kv"]  # (N, L, C+R)
    assert np.array_equal(kv_naive[:, 0], kv_absorbed[:, 0])  # layer 0: same inputs, same rows
    assert np.abs(kv_naive - kv_absorbed).max() < 1e-5  # later layers: rounding of earlier ones
    assert attention.prefer_naive(512, 4096, 16, 512, 128, 128)  # V2-Lite layer, prefill chunk
    assert not attention.prefer_naive(1, 4096, 16, 512, 128, 128)  # decode
    assert not attention.prefer_naive(512, 8192, 128, 512, 128, 128)  # V3: too big to decompress


@pytest.mark.parametrize("name", ["ds-v2-lite", "plm", "minicpm3"])
def test_truncate_then_continue(models, name):
    ids = np.load(TINY / f"{name}.ref.npz")["tokens_0"]
    m = tiny(models, name)
    full = m.prefill(ids)
    m.cache.truncate(25)
    assert np.abs(m.prefill(ids[25:]) - full[25:]).max() < 1e-4
    assert m.prefill([int(ids[0])], all_logits=False).shape == (1, m.cfg.n_vocab)


@pytest.mark.parametrize("name", ["ds-v3", "plm", "minicpm3"])
def test_cache_layout_is_c_then_k_pe(models, name):
    m = tiny(models, name)
    cfg = m.cfg
    assert m.cache.kind == "mla"
    assert (m.cache.a_width, m.cache.b_width) == (cfg.kv_lora_rank, cfg.rope_dim)
    assert m.cache.kv_bytes_per_token == 4 * cfg.n_layer * (cfg.kv_lora_rank + cfg.rope_dim)


def test_minicpm3_rope_factors_follow_the_context_size(models):
    """llama.cpp takes rope_factors_long for every position once the context size exceeds the
    original context (256), whatever the position: the first 40 tokens differ between 256 and 257."""
    ids = np.load(TINY / "minicpm3.ref.npz")["tokens_0"]
    short, long = tiny(models, "minicpm3", 256), tiny(models, "minicpm3", 257)
    assert (short.rope_factors, long.rope_factors) == ("short", "long")
    assert np.abs(short.prefill(ids) - long.prefill(ids)).max() > 1e-3
    a = tiny(models, "minicpm3", 257).prefill(ids[:8])
    assert np.array_equal(a, tiny(models, "minicpm3", 1024).prefill(ids[:8]))


@pytest.mark.parametrize("name", ["plm", "minicpm3"])
def test_llama_cpp_numerics_refused_in_one_line(name):
    with pytest.raises(ModelError, match=f"llama.cpp numerics do not cover {name} models"):
        load(str(TINY / f"{name}.gguf"), n_ctx=64, numerics="llama.cpp")


def test_plm_and_minicpm3_layouts(models):
    plm, cpm = tiny(models, "plm").cfg, tiny(models, "minicpm3").cfg
    assert tiny(models, "plm").cache.kind == tiny(models, "minicpm3").cache.kind == "mla"
    assert (plm.q_lora_rank, plm.mla_split, plm.tied_output, plm.n_dense, plm.n_expert) == (0, False, True, 3, 0)
    assert (cpm.q_lora_rank, cpm.mla_split, cpm.tied_output, cpm.n_dense, cpm.rope_orig_ctx) == (96, False, False, 3,
                                                                                                  256)
    assert tiny(models, "plm").output is tiny(models, "plm").w["token_embd"]


# --- file variants -------------------------------------------------------------------------------------


def test_legacy_kv_b_equals_split(tmp_path):
    ids = np.random.default_rng(2).integers(0, 268, size=30)
    out = {}
    for split in (True, False):
        path = write_deepseek2(tmp_path / f"m{split}.gguf", DS2Spec(split=split, yarn_factor=4.0))
        m = engine(path)
        assert m.cfg.mla_split is split
        out[split] = m.prefill(ids)
    assert np.abs(out[True] - out[False]).max() < 1e-5


def test_lite_is_decided_by_tensors_not_layer_count(tmp_path):
    ids = np.arange(60, 72)
    # 27 layers (the count llama.cpp once took for "lite") but with q_lora tensors
    path = write_deepseek2(tmp_path / "q27.gguf", DS2Spec(n_layer=27, n_dense=26, n_embd=32))
    m = engine(path)
    assert m.cfg.q_lora_rank == 32 and "blk.0.attn_q_b" in m.w
    assert np.abs(m.prefill(ids) - naive_logits(path, ids)).max() < 2e-4
    path = write_deepseek2(tmp_path / "lite3.gguf", DS2Spec(q_lora_rank=0))
    m = engine(path)
    assert m.cfg.q_lora_rank == 0 and "blk.0.attn_q_b" not in m.w


@pytest.mark.parametrize("qtypes", [{"attn_k_b": "Q5_0"}, {"attn_k_b": "Q5_1"}, {"attn_k_b": "IQ4_NL"},
                                    {"attn_v_b": "Q4_1", "ffn_down_exps": "Q4_0"}])
def test_fallback_quant_types(tmp_path, qtypes):
    """Q4_K_M-style files carry Q5_0/Q5_1/IQ4_NL attn_k_b (row of qk_nope); all dequantize."""
    spec = DS2Spec(qk_nope=32, v_head=32, qtypes=qtypes, raw_quant=True)  # IQ4_NL: random blocks
    path = write_deepseek2(tmp_path / "m.gguf", spec)
    ids = np.arange(30, 50)
    assert np.abs(engine(path).prefill(ids) - naive_logits(path, ids)).max() < 2e-4


def test_merged_gate_up_experts_equal_separate(tmp_path):
    ids = np.arange(10, 40)
    a = engine(write_deepseek2(tmp_path / "a.gguf", DS2Spec(merged_gate_up=True))).prefill(ids)
    b = engine(write_deepseek2(tmp_path / "b.gguf", DS2Spec())).prefill(ids)
    assert np.array_equal(a, b)


def test_split_model_loads_from_any_part(tmp_path):
    ids = np.arange(10, 40)
    whole = load(str(write_deepseek2(tmp_path / "one.gguf", DS2Spec()))).prefill(ids)
    first = write_deepseek2(tmp_path / "m.gguf", DS2Spec(shards=3))
    assert first.name == "m-00001-of-00003.gguf"
    assert np.array_equal(load(str(first)).prefill(ids), whole)
    assert np.array_equal(load(str(tmp_path / "m-00003-of-00003.gguf")).prefill(ids), whole)
    (tmp_path / "m-00002-of-00003.gguf").unlink()
    with pytest.raises(ModelError, match="m-00002-of-00003.gguf: no such file"):
        load(str(first))


def test_tied_output_uses_token_embd(tmp_path):
    path = write_deepseek2(tmp_path / "t.gguf", DS2Spec(tied_output=True))
    m = engine(path)
    assert m.cfg.tied_output and m.output is m.w["token_embd"]


# --- RoPE / YaRN ----------------------------------------------------------------------------------------


def _cfg(tmp_path, **kw):
    path = write_deepseek2(tmp_path / "c.gguf", DS2Spec(**kw))
    reader = open_gguf(str(path))
    return load_config(reader, str(path), Tensors(reader, str(path)))


@pytest.mark.parametrize(
    "factor, log_mul, expected",
    [(40.0, 0.1, 0.135234), (40.0, 0.0707, 0.114721), (32.0, 0.1, 0.130861), (64.0, 0.1, 0.144680)],
)
def test_yarn_kq_scale_and_unit_magnitude(tmp_path, factor, log_mul, expected):
    """mla-spec 4.4: kq_scale = mscale^2 / sqrt(d_qk) (V3/R1, V2, Kimi-K2, K2-0905), magnitude 1."""
    cfg = _cfg(tmp_path, qk_nope=128, qk_rope=64, yarn_factor=factor, yarn_orig_ctx=4096, yarn_log_mul=log_mul)
    params, kq_scale = mla_rope(cfg)
    assert kq_scale == pytest.approx(expected, abs=2e-6)
    from colichat.engine.rope import rope_tables, yarn_corr_dims

    assert yarn_corr_dims(params) == (10.0, 23.0)
    cos, sin = rope_tables(params, 20000)
    assert np.abs(cos**2 + sin**2 - 1).max() < 1e-5


def test_no_yarn_scale(tmp_path):
    cfg = _cfg(tmp_path, qk_nope=128, qk_rope=64)
    assert mla_rope(cfg)[1] == pytest.approx(1 / math.sqrt(192))


# --- routing ----------------------------------------------------------------------------------------------


def _route(probs, gating=2, **kw):
    """Route one token whose router probabilities are `probs` (identity router on logit inputs)."""
    p = np.asarray(probs, dtype=np.float64)
    logits = np.log(p / (1 - p)) if gating == 2 else np.log(p)
    x = logits.astype(np.float32)[None, :]
    bias = kw.pop("bias", None)
    return route(x, np.eye(p.size, dtype=np.float32), bias, Routing(gating=gating, **kw))


def test_group_selection_uses_top2_sum():
    # group A = experts 0-2 (max 0.9, top-2 sum 1.0), group B = 3-5 (max 0.6, top-2 sum 1.2)
    ids, w = _route([0.9, 0.1, 0.1, 0.6, 0.6, 0.01], n_used=2, n_group=2, n_group_used=1)
    assert sorted(ids[0].tolist()) == [3, 4]
    ids, _ = _route([0.9, 0.1, 0.1, 0.6, 0.6, 0.01], n_used=2, n_group=1, n_group_used=1)  # no groups
    assert sorted(ids[0].tolist()) == [0, 3]


def test_bias_selects_but_does_not_weigh():
    bias = np.array([0, 0, 0.5, 0], dtype=np.float32)
    ids, w = _route([0.8, 0.7, 0.3, 0.1], n_used=2, bias=bias)
    assert sorted(ids[0].tolist()) == [0, 2]
    assert dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))[2] == pytest.approx(0.3, abs=1e-6)


def test_weight_norm_and_scale_rules():
    probs = [0.8, 0.6, 0.2, 0.1]
    _, w = _route(probs, n_used=2)  # no norm, scale 0: raw probabilities
    assert sorted(w[0].tolist()) == pytest.approx([0.6, 0.8], abs=1e-6)
    _, w = _route(probs, n_used=2, scale=1.0)  # 1: not applied either
    assert sorted(w[0].tolist()) == pytest.approx([0.6, 0.8], abs=1e-6)
    _, w = _route(probs, n_used=2, norm=True, scale=2.5)
    assert sorted(w[0].tolist()) == pytest.approx([2.5 * 0.6 / 1.4, 2.5 * 0.8 / 1.4], abs=1e-6)
    _, w = _route([1e-6, 2e-6, 1e-7], n_used=2, norm=True)  # tiny sum: clamped at 6.1035e-5
    assert sorted(w[0].tolist()) == pytest.approx([1e-6 / 6.1035e-5, 2e-6 / 6.1035e-5], rel=1e-3)
    ids, w = _route([0.5, 0.2, 0.3], gating=1, n_used=1)  # softmax gating
    assert ids[0].tolist() == [0] and w[0, 0] == pytest.approx(0.5, abs=1e-6)


def test_batched_moe_groups_tokens_by_expert(tmp_path):
    """Many tokens at once (grouped by expert) equal one token at a time."""
    path = write_deepseek2(tmp_path / "m.gguf", DS2Spec(n_expert=16, n_expert_used=4, n_group=4, n_group_used=3))
    ids = np.random.default_rng(3).integers(0, 268, size=64)
    m = engine(path)
    whole = m.prefill(ids)
    m.reset()
    steps = np.stack([m.decode(int(i)) for i in ids])
    assert np.abs(whole - steps).max() < 1e-4


# --- expert cache and memory -----------------------------------------------------------------------------


def test_expert_cache_is_bounded_and_exact(tmp_path):
    path = write_deepseek2(tmp_path / "m.gguf", DS2Spec(n_expert=16, qtype="Q8_0", n_embd=64, n_ff_exp=32))
    ids = np.arange(40, 80)
    big, small = engine(path, expert_cache=64), engine(path, expert_cache=0.05)  # MiB; 1 expert = 24 KiB
    assert np.array_equal(big.prefill(ids), small.prefill(ids))
    assert np.array_equal(big.prefill(ids[:5]), small.prefill(ids[:5]))
    assert small.experts.bytes <= small.experts.capacity and len(small.experts.entries) == 2
    assert big.experts.hits > 0 and small.experts.misses > big.experts.misses
    est = small.memory_estimate()
    assert est.experts == small.experts.capacity and est.experts_f32 == 2 * 16 * 3 * 32 * 64 * 4
    assert est.dense == small.weight_bytes and est.kv_per_token == small.cache.record_bytes
    assert "expert cache" in str(est) and "B/token" in str(est)


def test_expert_cache_default_follows_available_memory(tmp_path, monkeypatch):
    """Not told a size, load() gives routed experts the least of half of what MemAvailable leaves after
    the dense weights and the KV cache and the GGUF's size less the dense weights, at least 512 MiB;
    with no /proc/meminfo, model.py's fixed default stands for the first (test_expert_cache.py has more)."""
    assert model_mod.auto_expert_cache_mib(None, 1 << 30) is None
    assert model_mod.auto_expert_cache_mib(10 << 30, 2 << 30) == 4096.0
    assert model_mod.auto_expert_cache_mib(3 << 30, 2 << 30) == 512.0  # the floor
    assert model_mod.auto_expert_cache_mib(10 << 30, 2 << 30, 1 << 30) == 1024.0  # the file's room
    path = str(write_deepseek2(tmp_path / "m.gguf", DS2Spec(n_expert=16, qtype="Q8_0", n_embd=64, n_ff_exp=32)))
    monkeypatch.setattr(model_mod, "available_memory", lambda: 8 << 30)
    m = load(path, n_ctx=128, kernels="numpy")  # (the kernel path has no expert cache: the page cache is it)
    assert model_mod.gguf_bytes(m.tensors) < m.weight_bytes  # Q8_0 file below its f32 weights: no room
    assert m.experts.capacity == model_mod.EXPERT_CACHE_MIN_MIB << 20
    assert load(path, n_ctx=128, expert_cache=1, kernels="numpy").experts.capacity == 1 << 20  # explicit wins
    monkeypatch.setattr(model_mod, "available_memory", lambda: None)
    monkeypatch.setattr(model_mod, "EXPERT_CACHE_MIN_MIB", 0)
    assert load(path, n_ctx=128, kernels="numpy").experts.capacity == 0  # the file's room (none) still bounds


@pytest.mark.parametrize("mib, shown", [(0.5, "1 MiB"), (0.05, "1 MiB"), (0, "0 MiB"), (2, "2 MiB"), (2.1, "3 MiB")])
def test_the_expert_cache_bound_shown_rounds_up_never_to_zero(mib, shown):
    est = model_mod.MemoryEstimate(dense=1 << 20, experts=int(mib * (1 << 20)), experts_f32=3 << 20,
                                   kv_per_token=1024, n_ctx=16)
    assert f" + expert cache <= {shown} (all experts as f32: 3 MiB)" in str(est)


def test_memory_estimate_dense_model(models):
    m = tiny(models, "ds-dense")
    est = m.memory_estimate()
    assert m.experts is None and est.experts == 0 and est.experts_f32 == 0
    assert est.total == m.weight_bytes + m.cache.record_bytes * m.n_ctx + model_mod.working_bytes(m.cfg)


# --- refusals and bad files -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deepseek2-ocr", "deepseek4", "glm5-next", "kimi-k3", "grok"])
def test_unsupported_mla_architectures_are_refused(tmp_path, arch):
    path = write_deepseek2(tmp_path / f"{arch}.gguf", DS2Spec(arch=arch))
    with pytest.raises(ModelError) as e:
        load(str(path))
    msg = str(e.value)
    assert f"'{arch}'" in msg and "not supported" in msg and str(path) in msg and "\n" not in msg


def test_mtp_blocks_load(models):
    """A current DeepSeek-V3 conversion keeps its MTP block (block_count counts it): the trunk is
    block_count - nextn_predict_layers layers and gives llama.cpp's logits; the MTP block's
    tensors are shape-checked and kept (test_engine_dsa.py runs it)."""
    m = tiny(models, "ds-v3-mtp")
    assert (m.cfg.n_layer, m.cfg.n_nextn) == (3, 1) and m.cache.n_layer == 3
    for case in ("ref", "long.ref"):
        ref = np.load(TINY / f"ds-v3-mtp.{case}.npz")
        m.reset()
        logits = m.prefill(ref["tokens_0"])
        assert np.abs(logits - ref["logits_0"]).max() < 1e-3
        assert np.array_equal(logits.argmax(1), ref["logits_0"].argmax(1))
    assert m.w["blk.3.nextn.eh_proj"].shape == (256, 512) and "blk.3.attn_in" in m.w


def test_malformed_mtp_files_are_refused(tmp_path):
    path = write_deepseek2(tmp_path / "mtp.gguf", DS2Spec(extra_keys={"deepseek2.nextn_predict_layers": 1}))
    with pytest.raises(ModelError, match="nextn_predict_layers is 1 but 'blk.2.nextn.eh_proj.weight' is missing"):
        load(str(path))
    path = write_deepseek2(tmp_path / "mtp2.gguf", DS2Spec(extra_tensors={"blk.2.nextn.eh_proj.weight": (64, 128)}))
    with pytest.raises(ModelError, match="MTP .nextn. tensors but no 'deepseek2.nextn_predict_layers'"):
        load(str(path))


@pytest.mark.parametrize(
    "change, tensor",
    [
        ({"drop": ("blk.1.attn_kv_a_norm.weight",)}, "blk.1.attn_kv_a_norm.weight"),
        ({"drop": ("blk.2.ffn_up_exps.weight",)}, "blk.2.ffn_up_exps.weight"),
        ({"drop": ("output_norm.weight",)}, "output_norm.weight"),
        ({"reshape": {"blk.2.attn_output.weight": (64, 48)}}, "blk.2.attn_output.weight"),
        ({"reshape": {"blk.1.ffn_down_exps.weight": (8, 64, 16)}}, "blk.1.ffn_down_exps.weight"),
        ({"reshape": {"blk.0.attn_k_b.weight": (4, 16, 32)}}, "blk.0.attn_k_b.weight"),
        ({"split": False, "reshape": {"blk.1.attn_kv_b.weight": (96, 32)}}, "blk.1.attn_kv_b.weight"),
    ],
)
def test_bad_tensor_gives_one_line_error(tmp_path, change, tensor):
    path = write_deepseek2(tmp_path / "bad.gguf", DS2Spec(**change))
    with pytest.raises(ModelError) as e:
        load(str(path))
    msg = str(e.value)
    assert str(path) in msg and f"'{tensor}'" in msg and "\n" not in msg


def test_trained_context_is_read_from_the_metadata_before_a_load_from_any_part(tmp_path):
    from colichat.engine import trained_context

    write_deepseek2(tmp_path / "m.gguf", DS2Spec(shards=3, context_length=3000))
    assert [trained_context(str(tmp_path / f"m-0000{k}-of-00003.gguf")) for k in (1, 2, 3)] == [3000] * 3
    (tmp_path / "not.gguf").write_bytes(b"GGUF" + bytes(20))
    assert [trained_context(str(tmp_path / name)) for name in ("none.gguf", "not.gguf")] == [None, None]
