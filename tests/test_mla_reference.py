"""llama.cpp numerics (engine/ggml_ops.py, engine/mla_reference.py): the deepseek2 forward computed
with llama.cpp's CPU arithmetic reproduces llama.cpp's logits on the tiny reference models, the Q8_0
one included, where the fast float32 engine cannot (see test_engine_mla.py)."""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import GREEDY, TINY_LLAMA, chat
from conftest import TINY
from gguf_factory import write_deepseek2

from colichat.engine import ggml_ops as G
from colichat.engine import load
from colichat.engine.gguf import ModelError

Q8 = str(TINY / "ds-v3.q8_0.gguf")


@pytest.fixture(scope="module")
def models():
    return {}


def ggml(models, name):
    if name not in models:
        models[name] = load(str(TINY / f"{name}.gguf"), n_ctx=512, numerics="llama.cpp")
    m = models[name]
    m.reset()
    return m


@pytest.mark.parametrize("case", ["ref", "long.ref"])
def test_q8_0_matches_llama_cpp(models, case):
    """The issue's bar for the Q8_0 file (argmax at >= 90% of positions, max abs difference < 0.25)
    on both cases. Measured: max 0.033 / 0.066; the logits are bit-identical to llama.cpp's at 39 of
    40 and 245 of 320 positions, the rest differ by one activation rounding (a 1-ulp difference
    before a Q8_0 rounding tie)."""
    ref = np.load(TINY / f"ds-v3.q8_0.{case}.npz")
    logits = ggml(models, "ds-v3.q8_0").prefill(ref["tokens_0"])
    diff = np.abs(logits - ref["logits_0"]).max(axis=1)
    assert diff.max() < 0.25
    assert np.mean(logits.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9
    assert np.mean(diff == 0) >= (0.95 if case == "ref" else 0.7)


@pytest.mark.parametrize("name,case", [("ds-v3", "long.ref"), ("ds-v2-lite", "ref"), ("ds-dense", "ref")])
def test_f32_files_match_llama_cpp(models, name, case):
    """F32 weights (no activation rounding): within 1e-5 like the fast engine; covers softmax
    gating, no q_lora, and head sizes that are not a multiple of 16 (vec_dot order)."""
    ref = np.load(TINY / f"{name}.{case}.npz")
    logits = ggml(models, name).prefill(ref["tokens_0"])
    assert np.abs(logits - ref["logits_0"]).max() < 2e-5
    assert np.array_equal(logits.argmax(1), ref["logits_0"].argmax(1))


def test_chunks_and_decode_are_bit_identical(models):
    """Each output element is summed in the same order whatever the chunk, so prefill in one chunk,
    in three, and token by token give the same bits (logits and cache)."""
    ids = np.load(TINY / "ds-v3.q8_0.ref.npz")["tokens_0"]
    m = ggml(models, "ds-v3.q8_0")
    whole, kv = m.prefill(ids), m.cache.records[: ids.size].copy()
    m.reset()
    parts = np.concatenate([m.prefill(ids[:17]), m.prefill(ids[17:30]), m.prefill(ids[30:])])
    assert np.array_equal(parts, whole)
    assert np.array_equal(m.cache.records[: ids.size], kv)
    m.reset()
    steps = np.stack([m.decode(int(i)) for i in ids])
    assert np.array_equal(steps, whole)


def test_same_cache_as_fast_numerics(models):
    """Both numerics fill the same latent cache (c, k_pe per layer), equal up to float rounding."""
    ids = np.load(TINY / "ds-v3.ref.npz")["tokens_0"]
    m = ggml(models, "ds-v3")
    m.prefill(ids)
    fast = load(str(TINY / "ds-v3.gguf"), n_ctx=512)
    fast.prefill(ids)
    a, b = m.cache.records[: ids.size], fast.cache.records[: ids.size]
    assert np.array_equal(a["token"], b["token"])
    assert np.allclose(a["kv"], b["kv"], rtol=0, atol=1e-5)


# --- the ops ----------------------------------------------------------------------------------------


def test_v_expf_is_close_to_exp():
    """ggml documents its exp as within 1.45 ulp plus rounding; measured here: at most 2.2 ulp."""
    x = np.linspace(-87, 88, 200001, dtype=np.float32)
    got, want = G.v_expf(x), np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 2.5 * np.spacing(want.astype(np.float32)))
    assert G.v_expf(np.array([-np.inf, -200.0], np.float32)).tolist() == [0.0, 0.0]


def test_quantize_q8_0_rounds_half_to_even():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [127.0, 0.5, 1.5, -2.5]  # amax 127: the scale is exactly 1
    q, d = G.quantize_q8_0(x)
    assert d.tolist() == [[1.0]]
    assert q[0, 0, :4].tolist() == [127, 0, 2, -2]


def test_matmuls_agree_with_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal((7, 64)).astype(np.float32)
    for k in (64, 50):  # tinyBLAS order; vec_dot order with a scalar tail
        want = x[:, :k].astype(np.float64) @ w[:, :k].T.astype(np.float64)
        assert np.allclose(G.matmul_f32(x[:, :k], w[:, :k]), want, rtol=1e-5, atol=1e-5)
    wq = rng.integers(-127, 128, (7, 2, 32)).astype(np.int8)
    wd = np.full((7, 2), 0.01, np.float32)
    xq, xd = G.quantize_q8_0(x)
    want = (xq * xd[..., None]).reshape(5, 64).astype(np.float64) @ (wq * wd[..., None]).reshape(7, 64).T
    assert np.allclose(G.matmul_q8_0(x, wq, wd), want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(G.GgmlWeight("Q8_0", q=wq, d=wd)(x), G.matmul_q8_0(x, wq, wd))


# --- what it refuses ----------------------------------------------------------------------------------


def test_refusals(tmp_path):
    with pytest.raises(ModelError, match="deepseek2 files only"):
        load(TINY_LLAMA, n_ctx=64, numerics="llama.cpp")
    q4 = write_deepseek2(tmp_path / "q4.gguf", n_layer=2, qtype="Q4_0")
    with pytest.raises(ModelError, match="Q4_0"):
        load(str(q4), n_ctx=64, numerics="llama.cpp")
    legacy = write_deepseek2(tmp_path / "legacy.gguf", n_layer=2, split=False)
    with pytest.raises(ModelError, match="attn_k_b"):
        load(str(legacy), n_ctx=64, numerics="llama.cpp")
    with pytest.raises(ValueError, match="numerics"):
        load(Q8, n_ctx=64, numerics="exact")


def test_cli_option(colichat_home):
    """--numerics llama.cpp answers in pipe mode; on a llama file it is refused in one line."""
    r = chat(colichat_home, ["--model", Q8, "--numerics", "llama.cpp", *GREEDY, "--max-tokens", "6", "--no-save"],
             "hello\n").ok()
    assert r.out.strip()
    assert "numerics: llama.cpp's CPU arithmetic" in r.err
    r = chat(colichat_home, ["--model", TINY_LLAMA, "--numerics", "llama.cpp"], "hello\n").failed()
    assert len(r.errors()) == 1 and "deepseek2 files only" in r.errors()[0]


def test_merged_gate_up_experts_equal_separate(tmp_path):
    """ffn_gate_up_exps holds [gate; up] per expert: every output element is summed the same way."""
    ids = np.arange(3, 40)
    spec = dict(qtype="Q8_0", qk_nope=32, v_head=32)  # every matrix row a whole number of Q8_0 blocks
    a = load(str(write_deepseek2(tmp_path / "a.gguf", merged_gate_up=True, **spec)), n_ctx=64, numerics="llama.cpp")
    b = load(str(write_deepseek2(tmp_path / "b.gguf", **spec)), n_ctx=64, numerics="llama.cpp")
    assert np.array_equal(a.prefill(ids), b.prefill(ids))
