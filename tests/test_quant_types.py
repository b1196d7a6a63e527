"""The quantized types gguf-py cannot write (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL) against llama.cpp's
logits, on two tiny llama files of them (data/quants/: make.py wrote them, llama.cpp 0.3.36 the references).

llama.kquants (Q3_K, Q4_K, Q5_K, IQ4_XS; output Q6_K): the kernels round x to Q8_K as ggml does and sum the
same integers, so a decode agrees with llama.cpp's to float rounding (measured 2.5e-7 and 3.1e-7 of the largest
logit), in both the default numerics and `--numerics llama.cpp`. A prefill agrees as far as the order of float
sums leaves each 8-bit rounding of x where llama.cpp's falls: where one value lies within a rounding of a code's
edge, a code moves, and the logits after it part by up to 1.5% (measured: `--numerics llama.cpp` at 32 of 40
positions within float rounding, 1.1% at most; the default numerics 1.5%, its attention summed in another order).
llama.q2q6nl (Q2_K, Q6_K, IQ4_NL): llama.cpp multiplies them with other kernels where a matrix's rows are a
multiple of 8 (its output matrix, 268 rows, agrees in the first file) and rounds x to Q8_0 with fp16 scales for
IQ4_NL: measured within 2.2% of the largest logit. The numpy path (float32 activations): within 2.8%.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REF

from colichat.engine import load, runs_kernels
from colichat.engine.architectures.reference import ggml_ops as G
from colichat.engine.gguf import kernels
from colichat.engine.gguf.qmatrix import QMatrix
from colichat.errors import ModelError

QUANTS = REF / "quants"
FLOAT_ORDER = 1e-5  # of the largest logit: the same arithmetic, float sums in another order (measured <= 3.1e-7)
INT8_BOUND = 0.03  # where an 8-bit rounding of x moves, or llama.cpp's kernels round otherwise (measured <= 0.022)
F32_BOUND = 0.05  # the numpy path's float32 activations against llama.cpp's 8-bit ones (measured <= 0.028)
TYPES = {"llama.kquants": {"Q3_K", "Q4_K", "Q5_K", "IQ4_XS", "Q6_K"}, "llama.q2q6nl": {"Q2_K", "Q6_K", "IQ4_NL"}}


def reference(name: str):
    return np.load(QUANTS / f"{name}.ref.npz")


def model(name: str, **kw):
    return load(str(QUANTS / f"{name}.gguf"), n_ctx=256, **kw)


def decoded(m, tokens) -> np.ndarray:
    return np.array([m.decode(int(t)) for t in tokens])  # (T, V)


def worst(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Each position's largest difference, over the largest logit of the case: (T,)."""
    return np.abs(got - want).max(1) / np.abs(want).max()


@pytest.mark.parametrize("name", TYPES)
def test_the_files_hold_their_types_on_the_kernel_path(name):
    m = model(name, kernels="numba")
    held = {q for w in m.w.values() if isinstance(w, QMatrix) for q in w.qtypes}
    assert held == TYPES[name] and held <= set(kernels.INT8_ACTIVATIONS)


@pytest.mark.parametrize("numerics", ["fast", "llama.cpp"])
def test_k_quant_decode_is_llama_cpp_s_to_float_rounding(numerics):
    ref = reference("llama.kquants")
    got = decoded(model("llama.kquants", numerics=numerics), ref["tokens_0"][:16])
    assert worst(got, ref["decode_logits_0"]).max() <= FLOAT_ORDER
    assert np.array_equal(got.argmax(1), ref["decode_logits_0"].argmax(1))


def test_k_quant_prefill_under_llama_cpp_numerics_is_llama_cpp_s_but_where_a_rounding_moves():
    ref = reference("llama.kquants")
    got = model("llama.kquants", numerics="llama.cpp").prefill(ref["tokens_0"])
    apart = worst(got, ref["logits_0"])  # (40,)
    assert apart.max() <= INT8_BOUND
    assert np.mean(apart <= FLOAT_ORDER) >= 0.75  # measured 32 of 40 positions
    assert np.mean(got.argmax(1) == ref["logits_0"].argmax(1)) >= 0.95


@pytest.mark.parametrize("numerics", ["fast", "llama.cpp"])
@pytest.mark.parametrize("name", TYPES)
def test_every_quantized_type_is_within_the_8_bit_bound_of_llama_cpp(name, numerics):
    ref = reference(name)
    got = model(name, numerics=numerics).prefill(ref["tokens_0"])
    assert worst(got, ref["logits_0"]).max() <= INT8_BOUND
    assert np.mean(got.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9
    steps = decoded(model(name, numerics=numerics), ref["tokens_0"][:16])
    assert worst(steps, ref["decode_logits_0"]).max() <= INT8_BOUND


@pytest.mark.parametrize("name", TYPES)
def test_the_numpy_path_is_within_the_float32_bound_of_llama_cpp(name):
    ref = reference(name)
    got = model(name, kernels="numpy").prefill(ref["tokens_0"])
    assert worst(got, ref["logits_0"]).max() <= F32_BOUND
    assert np.mean(got.argmax(1) == ref["logits_0"].argmax(1)) >= 0.9


def test_llama_cpp_numerics_refuse_k_quants_without_the_kernels(monkeypatch):
    monkeypatch.setattr(G.kernels, "problem", lambda: "numba cannot be imported (test)")
    with pytest.raises(ModelError, match=r"Q\d_K weights .* compiled kernels, which cannot run here"):
        model("llama.kquants", numerics="llama.cpp")


def test_the_start_readies_the_kernels_where_llama_cpp_numerics_take_them():
    """runs_kernels: what the chat's start compiles (or loads) before loading, and says so on a first start."""
    kquants, q8 = str(QUANTS / "llama.kquants.gguf"), str(REF / "tiny" / "ds-v3.q8_0.gguf")
    assert runs_kernels(kquants, "auto", "llama.cpp") and runs_kernels(kquants, "auto", "fast")
    assert not runs_kernels(q8, "auto", "llama.cpp")  # (Q8_0: the numerics' own numpy products)
    assert not runs_kernels(kquants, "numpy", "fast")
