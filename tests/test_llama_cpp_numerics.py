"""llama.cpp numerics (engine/architectures/reference/: ggml_ops.py, deepseek2.py, llama.py): the forward pass
computed with llama.cpp's CPU arithmetic gives llama.cpp's logits bit for bit on every reference
file, the Q8_0 one included (where the fast float32 engine cannot meet the bar: test_engine_mla.py),
and the default model's greedy answers token for token."""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import GREEDY, chat
from conftest import REF, TINY
from gguf_factory import write_deepseek2

from colichat.engine import load
from colichat.engine.architectures.reference import ggml_ops as G
from colichat.errors import ModelError

Q8 = str(TINY / "ds-v3.q8_0.gguf")
TINY_MODELS = ["ds-v3.q8_0", "ds-v3", "ds-v2-lite", "ds-dense", "llama"]


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
def test_q8_0_meets_the_bar(models, case):
    """The issue's bar for the Q8_0 file: argmax at >= 90% of positions, max abs difference < 0.25,
    on both cases (the next test shows more: no difference at all)."""
    ref = np.load(TINY / f"ds-v3.q8_0.{case}.npz")
    logits = ggml(models, "ds-v3.q8_0").prefill(ref["tokens_0"])
    assert np.abs(logits - ref["logits_0"]).max() < 0.25
    assert np.mean(logits.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9


@pytest.mark.parametrize("case", ["ref", "long.ref"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_bit_identical(models, name, case):
    """Every position of every case: the same float32 bits as llama.cpp. Covers Q8_0 activation
    rounding, YaRN past the original context, sigmoid and softmax routing with groups, q_lora and
    attn_q, head sizes that are not a multiple of 16, F32 experts (ggml_mul_mat_id), and GQA."""
    ref = np.load(TINY / f"{name}.{case}.npz")
    logits = ggml(models, name).prefill(ref["tokens_0"])
    assert np.array_equal(logits, ref["logits_0"])


def test_chunks_equal_one_prefill_and_decode_is_close(models):
    """Chunks of two or more tokens take the same kernels as one chunk: the same bits, logits and
    cache. A single token does not (tinyBLAS refuses one column, so the weighted sum of the values
    runs in ggml_vec_dot_f32's order), in llama.cpp as here: decode agrees to float rounding."""
    ids = np.load(TINY / "ds-v3.q8_0.ref.npz")["tokens_0"]
    m = ggml(models, "ds-v3.q8_0")
    whole, kv = m.prefill(ids), m.cache.records[: ids.size].copy()
    m.reset()
    parts = np.concatenate([m.prefill(ids[:17]), m.prefill(ids[17:30]), m.prefill(ids[30:])])
    assert np.array_equal(parts, whole)
    assert np.array_equal(m.cache.records[: ids.size], kv)
    m.reset()
    m.prefill(ids[:30])
    steps = np.stack([m.decode(int(i)) for i in ids[30:]])
    assert np.abs(steps - whole[30:]).max() < 0.1
    assert np.array_equal(steps.argmax(1), whole[30:].argmax(1))


@pytest.mark.default_model
def test_default_model_matches_llama_cpp(default_model_path):
    """SmolLM2 (Q4_1 weights, Q8_1 activations, Q8_0 tied output): the top-20 logits at every
    position and all logits at the last one are llama.cpp's, bit for bit, on the four chat cases;
    greedy decoding gives llama.cpp's continuation token for token. The fast engine's greedy answers
    leave llama.cpp's at the first token of case 0 and the sixth of case 2."""
    ref = np.load(REF / "smollm2" / "chat.ref.npz")
    m = load(default_model_path, n_ctx=256, numerics="llama.cpp")
    greedy = {0: 8, 2: 7}  # the cases whose continuation is checked, and how many tokens of it
    for i in range(4):
        m.reset()
        logits = m.prefill(ref[f"tokens_{i}"])
        top = np.take_along_axis(logits, ref[f"topk_ids_{i}"], axis=1)
        assert np.array_equal(top, ref[f"topk_logits_{i}"]), i
        assert np.array_equal(logits[-1], ref[f"last_logits_{i}"]), i
        last, answer = logits[-1], []
        for _ in range(greedy.get(i, 0)):  # decoding on from the cache the prefill filled
            answer.append(int(last.argmax()))
            last = m.decode(answer[-1])
        assert answer == ref[f"greedy_{i}"][: greedy.get(i, 0)].tolist(), i


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
    q, d, s = G.quantize_q8_0(x)
    assert d.tolist() == [[1.0]] and s.tolist() == [[127.0]]  # q8_1's d * sum(q): 127 + 0 + 2 - 2
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
    xq, xd, _ = G.quantize_q8_0(x)
    want = (xq * xd[..., None]).reshape(5, 64).astype(np.float64) @ (wq * wd[..., None]).reshape(7, 64).T
    assert np.allclose(G.GgmlWeight("Q8_0", q=wq, d=wd)(x), want, rtol=1e-5, atol=1e-5)


# --- what it refuses ----------------------------------------------------------------------------------


def test_refusals(tmp_path):
    q4 = write_deepseek2(tmp_path / "q4.gguf", n_layer=2, qtype="Q4_0")
    with pytest.raises(ModelError, match="Q4_0"):
        load(str(q4), n_ctx=64, numerics="llama.cpp")
    legacy = write_deepseek2(tmp_path / "legacy.gguf", n_layer=2, split=False)
    with pytest.raises(ModelError, match="attn_k_b"):
        load(str(legacy), n_ctx=64, numerics="llama.cpp")
    with pytest.raises(ValueError, match="numerics"):
        load(Q8, n_ctx=64, numerics="exact")


@pytest.mark.process
def test_cli_option(colichat_home, tmp_path):
    """--numerics llama.cpp answers in pipe mode, the same on a second start (prepared weights); a file
    with other weight types is refused in one line."""
    args = ["--model", Q8, "--numerics", "llama.cpp", *GREEDY, "--max-tokens", "6", "--no-save"]
    r = chat(colichat_home, args, "hello\n").ok()
    assert r.out.strip()
    assert "numerics: llama.cpp's CPU arithmetic" in r.err
    assert "no speculative decoding whatever --draft says" in r.err  # the default --draft 15 does nothing here
    again = chat(colichat_home, args, "hello\n").ok()  # second start: weights mapped from the prepared cache
    assert again.out == r.out
    q4 = write_deepseek2(tmp_path / "q4.gguf", n_layer=2, qtype="Q4_0")
    r = chat(colichat_home, ["--model", q4, "--numerics", "llama.cpp"], "hello\n").failed()
    assert len(r.errors()) == 1 and "Q4_0" in r.errors()[0] and "default numerics" in r.errors()[0]


def test_merged_gate_up_experts_equal_separate(tmp_path):
    """ffn_gate_up_exps holds [gate; up] per expert: every output element is summed the same way."""
    ids = np.arange(3, 40)
    spec = dict(qtype="Q8_0", qk_nope=32, v_head=32)  # every matrix row a whole number of Q8_0 blocks
    a = load(str(write_deepseek2(tmp_path / "a.gguf", merged_gate_up=True, **spec)), n_ctx=64, numerics="llama.cpp")
    b = load(str(write_deepseek2(tmp_path / "b.gguf", **spec)), n_ctx=64, numerics="llama.cpp")
    assert np.array_equal(a.prefill(ids), b.prefill(ids))


@pytest.mark.process
@pytest.mark.default_model
def test_cli_answers_as_llama_cpp(colichat_home):
    """End to end through the chat program: the first prompt of the reference (default system prompt,
    "What is the capital of France?") answered greedily with --numerics llama.cpp prints llama.cpp's
    continuation. (It is "L'Étoile, la Mar...", as the kernel path's is; the numpy path answers "The capital of
    France is Paris.")"""
    from colichat.engine import load_tokenizer
    from colichat.models.default import default_model_path

    ref = np.load(REF / "smollm2" / "chat.ref.npz")
    want = load_tokenizer(default_model_path()).decode(ref["greedy_0"][:8].tolist())
    r = chat(colichat_home, ["--numerics", "llama.cpp", *GREEDY, "--max-tokens", "8", "--no-save",
                             "-p", "What is the capital of France?"]).ok()
    assert r.out.decode() == want + "\n"
