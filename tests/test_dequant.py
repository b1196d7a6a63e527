"""engine/gguf/dequant.py: the fast dequantizers give gguf-py's values exactly, on every bit pattern."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from colichat.engine.gguf import dequant


def _random_blocks(name: str, shape: tuple, seed: int = 1) -> np.ndarray:
    """Random bytes: every code, scale and minimum (fp16 NaN/inf included, compared as equal)."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]
    return np.random.default_rng(seed).integers(0, 256, (*shape[:-1], shape[-1] * size), dtype=np.uint8)


def _gguf_py(raw: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])


@pytest.mark.parametrize("name", sorted(dequant.FAST))
def test_same_values_as_gguf_py(name):
    raw = _random_blocks(name, (3, 5, 4))  # 3 experts x 5 rows of 4 blocks
    want = _gguf_py(raw, name)
    with np.errstate(invalid="ignore", over="ignore"):
        got = dequant.FAST[name](raw[1])  # one expert, as ExpertCache reads it
    assert got.dtype == np.float32
    assert np.array_equal(got.reshape(want[1].shape), want[1], equal_nan=True)


@pytest.mark.parametrize("name", sorted(dequant.FAST))
def test_chunks_and_out(name, monkeypatch):
    """Many chunks with a short last one; `out` (a slot of a slab) is written in place and returned."""
    monkeypatch.setattr(dequant, "CHUNK", 1024)  # 4 K-quant blocks, 32 of 32 values
    raw = _random_blocks(name, (7, 19), seed=2)
    want = _gguf_py(raw, name).reshape(-1)
    slab = np.full((3, want.size), 7.0, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        got = dequant.FAST[name](raw, out=slab[1])
        alone = dequant.FAST[name](raw)
    assert np.shares_memory(got, slab[1]) and got.shape == (want.size,)
    assert np.array_equal(slab[1], want, equal_nan=True) and np.array_equal(alone, want, equal_nan=True)
    assert (slab[0] == 7).all() and (slab[2] == 7).all()


def test_out_of_the_wrong_kind_is_refused():
    """Of the wrong size, dtype or layout (4 blocks of Q8_0 are 128 values)."""
    for bad in np.empty(10, np.float32), np.empty(128, np.float64), np.empty((2, 128), np.float32)[:, ::2]:
        with pytest.raises(ValueError, match="float32"):
            dequant.q8_0(_random_blocks("Q8_0", (4,)), out=bad)


def test_iq4_xs_table_is_gguf_pys():
    assert np.array_equal(dequant._IQ4NL, np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_real_scales_through_tensors(name):
    """The quantizer's own scales (no NaN): the fast path and gguf-py agree bit for bit."""
    qtype = gguf.GGMLQuantizationType[name]
    a = np.random.default_rng(0).standard_normal((3, 40, 96), dtype=np.float32)
    q = gguf.quants.quantize(a, qtype)
    ref = gguf.quants.dequantize(q[1], qtype)
    assert np.array_equal(dequant.FAST[name](q[1]).reshape(ref.shape), ref)
