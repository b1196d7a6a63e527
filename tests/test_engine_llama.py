"""The llama engine agrees with llama.cpp (tiny random model and the real default model)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMOLLM2_REF, TINY

from colichat.engine import load
from colichat.errors import ModelError


@pytest.fixture(scope="module")
def tiny_llama():
    return load(str(TINY / "llama.gguf"), n_ctx=512)


@pytest.mark.parametrize("case", ["llama.ref.npz", "llama.long.ref.npz"])
def test_tiny_llama_matches_llama_cpp(tiny_llama, case):
    ref = np.load(TINY / case)
    tiny_llama.reset()
    logits = tiny_llama.prefill(ref["tokens_0"])
    assert logits.shape == ref["logits_0"].shape
    assert np.abs(logits - ref["logits_0"]).max() < 2e-3
    assert np.array_equal(logits.argmax(1), ref["logits_0"].argmax(1))


def test_chunked_prefill_equals_decode(tiny_llama):
    ids = np.load(TINY / "llama.ref.npz")["tokens_0"]
    tiny_llama.reset()
    whole = tiny_llama.prefill(ids)
    whole_cache = tiny_llama.cache.records[: len(ids)].copy()
    tiny_llama.reset()
    parts = np.concatenate([tiny_llama.prefill(ids[:7]), tiny_llama.prefill(ids[7:30]), tiny_llama.prefill(ids[30:])])
    tiny_llama.reset()
    steps = np.stack([tiny_llama.decode(int(i)) for i in ids])
    assert np.allclose(parts, whole, atol=1e-4) and np.allclose(steps, whole, atol=1e-4)
    assert np.allclose(tiny_llama.cache.records[: len(ids)]["kv"], whole_cache["kv"], atol=1e-5)
    assert tiny_llama.cache.token_ids() == ids.tolist()


def test_truncate_then_continue_matches_fresh(tiny_llama):
    ids = np.load(TINY / "llama.ref.npz")["tokens_0"]
    tiny_llama.reset()
    full = tiny_llama.prefill(ids)
    tiny_llama.cache.truncate(25)
    again = tiny_llama.prefill(ids[25:])
    assert np.allclose(again, full[25:], atol=1e-4)


def test_prefill_past_context_is_refused(tiny_llama):
    tiny_llama.reset()
    with pytest.raises(ModelError, match="context full"):
        tiny_llama.prefill(np.zeros(513, dtype=np.int32))
    assert tiny_llama.cache.length == 0


@pytest.mark.default_model
def test_smollm2_matches_llama_cpp(default_model):
    """llama.cpp multiplies Q4_1 weights with 8-bit activations, so logits differ by up to ~2:
    we rely on the argmax agreeing at >= 90% of all positions and the same top-5 at the last."""
    ref = np.load(SMOLLM2_REF)
    agree = total = 0
    for i in range(4):
        default_model.reset()
        logits = default_model.prefill(ref[f"tokens_{i}"])
        agree += int(np.sum(logits.argmax(1) == ref[f"topk_ids_{i}"][:, 0]))
        total += len(logits)
        last = ref[f"last_logits_{i}"]
        assert set(np.argsort(-logits[-1])[:5]) == set(np.argsort(-last)[:5]), f"case {i}"
    assert agree / total >= 0.9


def test_decode_after_a_long_prompt_matches_prefill(tiny_llama):
    """Decoding the tokens after 252 cached ones gives the logits one prefill of them all gives."""
    ids = np.load(TINY / "llama.long.ref.npz")["tokens_0"]
    assert len(ids) > 260
    tiny_llama.reset()
    whole = tiny_llama.prefill(ids)
    tiny_llama.reset()
    tiny_llama.prefill(ids[:252])
    steps = np.stack([tiny_llama.decode(int(i)) for i in ids[252:]])
    assert np.allclose(steps, whole[252:], atol=1e-4)
