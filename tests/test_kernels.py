"""engine/gguf/kernels.py: the compiled kernels against gguf-py's dequantizer and a float64 product.

For each type: random blocks (gguf-py's quantize of random data where it has one, else random codes and
scale bytes under valid fp16 scales), then
- dequantize gives gguf-py's values bit for bit (every bit pattern too, NaN and inf scales included);
- matvec is within the contract's bound of x @ dequant(W).T taken in float64: 1e-5 * sum |x| |W|, plus, for
  the types whose matvec rounds x to 8 bits (kernels.INT8_ACTIVATIONS: Q8_K per 256 values, Q8_0 per 32),
  that rounding's: half of x's scale (the block's max |x| / 127) times sum |W| over each block;
- the bits of out[t, r] do not depend on T, on how the rows are split, or on the thread count.
The kernels are compiled once per session, kept in pytest's cache directory between sessions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import gguf
import numpy as np
import pytest

from colichat.engine.gguf import kernels

TYPES = sorted(kernels.TYPES)
BOUND = 1e-5  # |matvec - float64 reference| <= BOUND * sum |x| |W| (the module's contract)
FP16_AT = {  # byte offsets of a block's fp16 scales (d, dmin), set to valid values in random blocks
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
}


@pytest.fixture(scope="session", autouse=True)
def compiled(tmp_path_factory):
    seconds = kernels.prepare(str(tmp_path_factory.getbasetemp()))  # (into the tests' NUMBA_CACHE_DIR: conftest)
    assert kernels.problem() is None
    return seconds


def qtype(name: str):
    return gguf.GGMLQuantizationType[name]


def random_rows(name: str, rows: int, z: int, seed: int = 0) -> np.ndarray:
    """(rows, row_bytes) uint8 of `z` values a row: random codes and scale bytes, valid fp16 scales
    (the float types: random values)."""
    rng = np.random.default_rng(seed)
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, z)).astype(np.float32)
        return gguf.quants.quantize(values, qtype(name)).view(np.uint8) if name == "BF16" else \
            values.astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    values, size = kernels.block(name)
    raw = rng.integers(0, 256, (rows, z // values, size), dtype=np.uint8)
    for at in FP16_AT[name]:
        scales = (rng.uniform(-1, 1, (rows, z // values)) * 2.0 ** rng.integers(-12, -2, (rows, z // values)))
        raw[:, :, at : at + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def quantized_rows(name: str, rows: int, z: int, seed: int = 0) -> np.ndarray:
    """gguf-py's quantize of random data where it has one, else random_rows."""
    if name in ("F32", "F16", "BF16"):
        return random_rows(name, rows, z, seed)
    try:
        data = np.random.default_rng(seed).standard_normal((rows, z)).astype(np.float32)
        return gguf.quants.quantize(data, qtype(name))
    except NotImplementedError:
        return random_rows(name, rows, z, seed)


def reference(name: str, w: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(w, qtype(name)).reshape(w.shape[0], -1)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(name):
    for w in (quantized_rows(name, 5, 512), random_rows(name, 5, 512, seed=1)):
        out = np.empty((5, 512), dtype=np.float32)
        kernels.dequantize(name, w, out)
        assert np.array_equal(out.view(np.uint32), reference(name, w).view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_every_bit_pattern(name):
    """Raw random bytes: NaN and inf scales too, compared as equal."""
    values, size = kernels.block(name)
    w = np.random.default_rng(3).integers(0, 256, (7, 4 * size), dtype=np.uint8)
    out = np.empty((7, 4 * values), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        kernels.dequantize(name, w, out)
    assert np.array_equal(out, reference(name, w), equal_nan=True)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("make", [quantized_rows, random_rows])
def test_matvec_within_the_bound_of_float64(name, make):
    z = 1024
    w = make(name, 48, z, seed=4)
    x = np.random.default_rng(5).standard_normal((3, z)).astype(np.float32)
    out = np.empty((3, 48), dtype=np.float32)
    kernels.matvec(name, w, x, out)
    W = reference(name, w).astype(np.float64)
    want = x.astype(np.float64) @ W.T
    bound = BOUND * np.abs(x).astype(np.float64) @ np.abs(W).T
    if name in kernels.INT8_ACTIVATIONS:  # x = dx qx + e, |e| <= dx / 2, dx = the block's max |x| / 127
        n = kernels.block(name)[0]  # (x's blocks are the weights' blocks: 32 or 256 values)
        half_dx = np.abs(x.reshape(3, -1, n)).max(2) / 254  # (T, blocks)
        bound += half_dx @ np.abs(W).reshape(48, -1, n).sum(2).T
    assert np.all(np.abs(out - want) <= bound)
    assert np.abs(out - want).max() > 0 or name == "F32"  # not a float64 product in disguise


def test_int8_activations_are_ggml_s_q8_k_rounding():
    """kernel_int8.q8_k is ggml's quantize_row_q8_K: per 256 values, the value of largest magnitude (the
    first of ties) maps to -127, every value to the nearest integer of x (-127 / max) (even on ties), at
    most 127; d = 1 / (-127 / max); the sums of each 16 codes. An all-zero block is zeros."""
    from colichat.engine.gguf.kernel_int8 import q8_k

    x = np.random.default_rng(11).standard_normal((2, 768)).astype(np.float32)
    x[0, 3], x[0, 300] = -9.0, 9.0  # a negative max; a block whose max is a positive 9
    x[1, 256:512] = 0
    x[1, 600:602] = 127 / 254 * np.float32(4.0), 4.0  # a value at exactly half a step
    qx, dx, bsums = q8_k(x)
    for t in range(2):
        for b in range(3):
            v = x[t, 256 * b : 256 * b + 256]
            top = v[np.argmax(np.abs(v))]
            iscale = np.float32(-127) / top if top else np.float32(0)
            want = np.minimum(127, np.rint(iscale * v)).astype(np.int8)
            assert np.array_equal(qx[t, 256 * b : 256 * b + 256], want)
            assert dx[t, b] == (np.float32(1) / iscale if top else 0)
            assert np.array_equal(bsums[t, 16 * b : 16 * b + 16], want.astype(np.int32).reshape(16, 16).sum(1))
    assert qx[0, 3] == qx[0, 300] == -127 and dx[0, 0] > 0 > dx[0, 1]  # (-9 and 9: d's sign differs)


def test_the_q8_0_product_reads_every_fp16_scale():
    """Q8_0's int8 product converts a block's fp16 scale in its own code (kernel_int8 _IR.half): every one
    of the 65,536 bit patterns, as a one-block row of codes 1 against x = 1, gives 32 times the scale
    (NaN for NaN, inf for inf, zeros and subnormals included, the sign kept)."""
    rows = np.zeros((1 << 16, 34), dtype=np.uint8)
    rows[:, :2] = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    rows[:, 2:] = 1
    out = np.empty((1, 1 << 16), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        kernels.matvec("Q8_0", rows, np.ones((1, 32), dtype=np.float32), out)
        want = 32 * np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64)
    assert np.array_equal(np.isnan(out[0]), np.isnan(want)) and np.array_equal(np.isinf(out[0]), np.isinf(want))
    finite = np.isfinite(want)
    assert np.all(np.abs(out[0][finite] - want[finite]) <= 1e-6 * np.abs(want[finite]))
    assert np.array_equal(np.sign(out[0][finite]), np.sign(want[finite]))  # (-0 sums to 0: zero either way)


@pytest.mark.parametrize("name", kernels.INT8_ACTIVATIONS)
def test_a_nan_or_inf_in_x_is_not_rounded_away(name):
    """x rounded to 8 bits: a NaN or inf in x still gives non-finite outputs (as the float32 kernels do),
    never a finite number that hides a broken activation."""
    w = quantized_rows(name, 8, 512)
    x = np.random.default_rng(12).standard_normal((3, 512)).astype(np.float32)
    x[0, 17], x[1, 300] = np.nan, np.inf
    out = np.empty((3, 8), dtype=np.float32)
    kernels.matvec(name, w, x, out)
    assert not np.isfinite(out[:2]).any() and np.isfinite(out[2]).all()


@pytest.mark.parametrize("name", TYPES)
def test_same_bits_for_any_t_and_any_row_split(name):
    """Any T the type's matvec takes (up to 16; 40 for the int8 products: groups of kernel_int8.NT rows and a
    rest), any split into row blocks, x given as it is or rounded once for every block."""
    z, n = 512, 40 if kernels.takes(name, 40) else 16
    w = random_rows(name, 40, z, seed=6)
    x = np.random.default_rng(7).standard_normal((n, z)).astype(np.float32)
    whole = np.empty((n, 40), dtype=np.float32)
    kernels.matvec(name, w, x, whole)
    for t in (0, 5, 15, n - 1):
        one = np.empty((1, 40), dtype=np.float32)
        kernels.matvec(name, w, x[t : t + 1], one)
        assert np.array_equal(one[0].view(np.uint32), whole[t].view(np.uint32))
    split = np.full((n, 40), np.nan, dtype=np.float32)
    xs = kernels.rounded(name, x)
    for a, b in ((0, 1), (1, 17), (17, 40)):
        kernels.matvec(name, w[a:b], xs, split[:, a:b])  # a column range of a larger out
    assert np.array_equal(split.view(np.uint32), whole.view(np.uint32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_same_bits_when_x_is_taken_a_chunk_of_rows_at_a_time(name):
    """A long row (131072 values) makes kernel_int8's chunks of x 4 rows: 10 rows are 4, 4 and 2, each
    row's products the bits of a one-row matvec."""
    z = 131072
    w = random_rows(name, 6, z, seed=16)
    x = np.random.default_rng(17).standard_normal((10, z)).astype(np.float32)
    whole = np.empty((10, 6), dtype=np.float32)
    kernels.matvec(name, w, x, whole)
    for t in range(10):
        one = np.empty((1, 6), dtype=np.float32)
        kernels.matvec(name, w, x[t : t + 1], one)
        assert np.array_equal(one[0].view(np.uint32), whole[t].view(np.uint32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_same_bits_from_two_threads(name):
    z = 2048
    w = random_rows(name, 256, z, seed=8)
    x = np.random.default_rng(9).standard_normal((2, z)).astype(np.float32)
    one = np.empty((2, 256), dtype=np.float32)
    kernels.matvec(name, w, x, one)
    two = np.full((2, 256), np.nan, dtype=np.float32)
    threads = [threading.Thread(target=kernels.matvec, args=(name, w[a:b], x, two[:, a:b]))
               for a, b in ((0, 128), (128, 256))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert np.array_equal(one.view(np.uint32), two.view(np.uint32))


def test_reads_the_map_in_place():
    """A read-only view (as a memory map gives) is taken as it is, written nowhere."""
    w = random_rows("Q4_K", 8, 256)
    w.setflags(write=False)
    out = np.empty((1, 8), dtype=np.float32)
    kernels.matvec("Q4_K", w, np.ones((1, 256), dtype=np.float32), out)
    assert np.all(np.isfinite(out))


def test_block_sizes_are_gguf_s():
    for name in TYPES:
        assert kernels.block(name) == gguf.GGML_QUANT_SIZES[qtype(name)]
        assert kernels.supported(name)
    assert not kernels.supported("IQ1_S")


def test_problem_says_why_without_numba(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    why = kernels.problem()
    assert why is not None and "numba" in why and "\n" not in why


def test_bad_shapes_are_caller_bugs():
    w = random_rows("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="T 1..256"):
        kernels.matvec("Q8_0", w, np.ones((257, 64), dtype=np.float32), np.empty((257, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="T 1..16"):
        kernels.matvec("F16", random_rows("F16", 4, 64), np.ones((17, 64), dtype=np.float32),
                       np.empty((17, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="is not what Q8_0"):
        kernels.matvec("Q8_0", w, kernels.rounded("Q4_K", np.ones((1, 256), dtype=np.float32)),
                       np.empty((1, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="do not hold"):
        kernels.matvec("Q8_0", w, np.ones((1, 96), dtype=np.float32), np.empty((1, 4), dtype=np.float32))


@pytest.mark.process
def test_a_later_start_loads_every_kernel_from_the_cache(tmp_path_factory, compiled):
    """A later process on the cache the session's kernels (and the attention) were compiled into compiles
    nothing."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    shutil.copytree(os.environ["NUMBA_CACHE_DIR"], cache / "kernels")  # a copy no other process rewrites
    code = ("import sys; from colichat.engine.gguf import kernels; kernels.prepare(sys.argv[1]); "
            "fs = [f for fs in kernels._COMPILED.functions.values() for f in fs] + list(kernels._COMPILED.attention); "
            "print(sum(sum(f.stats.cache_misses.values()) for f in fs),"
            " len(kernels._COMPILED.functions), kernels.problem())")
    # (the copy may hold an index another process of the run was rewriting: the first start completes it, the
    # second must compile nothing)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    for _ in range(2):
        got = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True,
                             timeout=600, env=env)
    assert got.stdout.split() == ["0", str(len(kernels.TYPES)), "None"], got.stderr


def test_an_unwritable_cache_directory_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR")  # (the tests' shared cache: colichat's own place here)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    assert kernels.cache_path(str(not_a_dir)) is None  # prepare() then compiles without numba's cache
    assert kernels.cache_path(None) is None
    assert kernels.cache_path(str(tmp_path)) == str(tmp_path / "kernels")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))  # numba's own variable moves it
    assert kernels.cache_path(str(tmp_path)) == str(tmp_path / "numba")


@pytest.mark.process
def test_the_int8_products_give_the_same_bits_without_vnni(tmp_path):
    """kernel_int8.py's portable vector IR (a CPU without int8 dot products: numba compiling for its
    "generic" CPU, in a process of its own) gives the bits vpdpbusd gives (or the same code, on a CPU
    without it): the integer sums are exact and the float steps the same."""

    x = np.random.default_rng(13).standard_normal((3, 1024)).astype(np.float32)
    rows = {name: random_rows(name, 64, 1024, seed=14) for name in kernels.INT8_ACTIVATIONS}
    np.savez(tmp_path / "in.npz", x=x, **rows)
    code = ("import sys, numpy as np; from colichat.engine.gguf import kernels, kernel_int8; "
            "d = np.load(sys.argv[1]); outs = {}\n"
            "for n in kernels.INT8_ACTIVATIONS:\n"
            "    outs[n] = np.empty((3, 64), np.float32); kernels.matvec(n, d[n], d['x'], outs[n])\n"
            "np.savez(sys.argv[2], vnni=kernel_int8._vnni(), **outs)")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert got.returncode == 0, got.stderr
    portable = np.load(tmp_path / "out.npz")
    assert not portable["vnni"]
    for name, w in rows.items():
        here = np.empty((3, 64), dtype=np.float32)
        kernels.matvec(name, w, x, here)
        assert np.array_equal(here.view(np.uint32), portable[name].view(np.uint32)), name
