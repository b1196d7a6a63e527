"""engine/dequant.py: the fast dequantizers give gguf-py's values exactly, on every bit pattern."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from colichat.engine import dequant


@pytest.mark.parametrize("name", sorted(dequant.FAST))
def test_same_values_as_gguf_py(name):
    """Random bytes cover every code, scale and minimum (fp16 NaN/inf included, compared as equal)."""
    qtype = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 256, (3, 5, 4 * size), dtype=np.uint8)  # 3 experts x 5 rows
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw, qtype)  # (3, 5, 4 * block)
        got = dequant.FAST[name](raw[1])  # one expert, as ExpertCache reads it
    assert got.dtype == np.float32
    assert np.array_equal(got.reshape(want[1].shape), want[1], equal_nan=True)


def test_real_scales_through_tensors():
    """Q8_0 with the quantizer's own scales (no NaN): the fast path and gguf-py agree bit for bit."""
    a = np.random.default_rng(0).standard_normal((3, 40, 96), dtype=np.float32)
    q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.quants.dequantize(q[1], gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequant.q8_0(q[1]).reshape(ref.shape), ref)
