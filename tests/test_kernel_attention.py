"""engine/gguf/kernel_attention.py: the compiled attention of decode and verify passes over a GQA cache, against
a float64 softmax, on rows laid out as the cache lays them (records of every layer's rows, a row stride apart).

- within BOUND of the float64 attention, for head sizes with and without a 32-value tail, and any J;
- row t of a pass of T queries is, bit for bit, the one-query pass at its position (speculative decoding), and
  the bits do not depend on which threads computed the parts of the rows;
- its exponential is within EXP_BOUND of float64's over float32's range, and a NaN score stays NaN;
- the same bits on numba's "generic" CPU (no AVX, no FMA): the order is the code's alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from colichat.engine.attention import gqa_attention
from colichat.engine.gguf import kernel_attention, kernels
from colichat.engine.threads import Workers

BOUND = 2e-6  # |compiled - float64| <= BOUND * max |v| (measured <= 2.0e-7 up to 4096 rows; numpy's path 2.7e-7)
EXP_BOUND = 2e-7  # relative error of its exp (a degree-7 polynomial in float32: measured 9.9e-8; numpy's 2.0e-7)


def cache_rows(n: int, g: int, e: int, layers: int = 3, seed: int = 0):
    """k, v (N, G E) float32: layer 1's rows of records like the cache's (an int32 token, then every layer's
    K and V rows: strided views, 4 bytes off alignment)."""
    record = np.dtype([("token", "<i4"), ("kv", "<f4", (layers, 2 * g * e))])
    rows = np.zeros(n, record)
    rows["kv"] = np.random.default_rng(seed).standard_normal((n, layers, 2 * g * e)).astype(np.float32)
    return rows["kv"][:, 1, : g * e], rows["kv"][:, 1, g * e :]


def queries(t: int, h: int, g: int, e: int, seed: int = 1) -> np.ndarray:
    """(T, H, E) roped queries as the llama layer gives them: the first H heads of (T, H + G, E)."""
    return (np.random.default_rng(seed).standard_normal((t, h + g, e)) * 2).astype(np.float32)[:, :h]


def float64_attention(q, k, v, pos0: int, scale: float) -> np.ndarray:
    t, h, e = q.shape
    g = k.shape[1] // e
    out = np.empty((t, h * e))
    for i in range(t):
        n = pos0 + i + 1
        kk = k[:n].reshape(n, g, e).astype(np.float64)
        vv = v[:n].reshape(n, g, e).astype(np.float64)
        for j in range(h):
            s = kk[:, j // (h // g)] @ q[i, j].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, j * e : (j + 1) * e] = p @ vv[:, j // (h // g)] / p.sum()
    return out


@pytest.mark.parametrize("h, g, e, n", [(9, 3, 64, 700), (4, 4, 72, 300), (8, 2, 128, 1100), (6, 1, 8, 40)])
@pytest.mark.parametrize("t", [1, 3, 16])
def test_within_the_bound_of_float64(h, g, e, n, t):
    k, v = cache_rows(n, g, e)
    q = queries(t, h, g, e)
    got = kernels.gqa_rows(q, k, v, n - t, 1 / np.sqrt(e))
    want = float64_attention(q, k, v, n - t, 1 / np.sqrt(e))
    assert np.abs(got - want).max() <= BOUND * np.abs(v).max()
    numpy_path = gqa_attention(q, k.reshape(n, g, e), v.reshape(n, g, e), n - t, 1 / np.sqrt(e))
    assert np.abs(got - numpy_path).max() <= BOUND * np.abs(v).max()  # (and the reference path agrees)


def test_a_pass_of_t_queries_gives_each_row_the_one_query_pass_bit_for_bit():
    k, v = cache_rows(500, 3, 64)
    q = queries(16, 9, 3, 64)
    rows = kernels.gqa_rows(q, k, v, 484, 0.125)
    for i in range(16):
        one = kernels.gqa_rows(q[i : i + 1], k, v, 484 + i, 0.125)
        assert np.array_equal(one.view(np.uint32), rows[i : i + 1].view(np.uint32)), i


def test_the_same_bits_whichever_threads_compute_the_parts():
    k, v = cache_rows(3 * kernel_attention.PART + 5, 3, 64)
    q = queries(4, 9, 3, 64)
    here = kernels.gqa_rows(q, k, v, k.shape[0] - 4, 0.125)
    workers = Workers(2)
    shared = kernels.gqa_rows(q, k, v, k.shape[0] - 4, 0.125, lambda compute, n: workers.run(compute, put, n))
    backwards = kernels.gqa_rows(q, k, v, k.shape[0] - 4, 0.125,
                                 lambda compute, n: [compute(i) for i in reversed(range(n))])
    assert np.array_equal(here.view(np.uint32), shared.view(np.uint32))
    assert np.array_equal(here.view(np.uint32), backwards.view(np.uint32))


def put(i, _):
    pass


def test_gqa_attention_takes_the_kernel_for_small_passes_only():
    k, v = cache_rows(64, 2, 16)
    q = queries(17, 4, 2, 16)
    kk, vv = k.reshape(64, 2, 16), v.reshape(64, 2, 16)
    small = gqa_attention(q[:16], kk, vv, 48, 0.25, compiled=True)
    assert np.array_equal(small, kernels.gqa_rows(q[:16], k, v, 48, 0.25))
    prefill = gqa_attention(q, kk, vv, 47, 0.25, compiled=True)  # (17 queries: numpy's matrix products)
    assert np.array_equal(prefill, gqa_attention(q, kk, vv, 47, 0.25))


def test_its_exp_is_within_the_bound_of_float64_and_keeps_nan():
    exp_sum = kernel_attention._exp_sum
    s = np.concatenate([np.linspace(-100, 0, 200_001), [0.0, -1e-30, -87.3, -88.0]]).astype(np.float32)
    got = s.copy()
    total = exp_sum(got, s.size, np.empty(s.size, np.int32))[1]
    want = np.exp(s.astype(np.float64))
    normal = want > np.finfo(np.float32).tiny * 2
    assert np.all(np.abs(got[normal] - want[normal]) <= EXP_BOUND * want[normal])
    tiny = np.finfo(np.float32).tiny  # (under twice float32's smallest normal: exp(max(x, -87.3)), about 1.2e-38)
    assert np.all((got[~normal] > 0) & (got[~normal] <= 2 * tiny * (1 + EXP_BOUND)))
    assert abs(total - want.sum()) <= 1e-6 * want.sum()
    with_nan = np.array([0.0, np.nan, -1.0], dtype=np.float32)
    exp_sum(with_nan, 3, np.empty(3, np.int32))
    assert np.isnan(with_nan[1]) and with_nan[0] == 1.0


def test_a_nan_key_gives_nan_to_its_heads_only():
    k, v = cache_rows(50, 2, 16)
    k = k.copy()
    k[7, :16] = np.nan  # KV head 0's key of row 7
    out = kernels.gqa_rows(queries(1, 4, 2, 16), k, v, 49, 0.25)
    assert np.isnan(out[0, :32]).all() and np.isfinite(out[0, 32:]).all()


def test_bad_shapes_are_caller_bugs():
    k, v = cache_rows(20, 2, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.gqa_rows(queries(1, 4, 2, 12), k, v, 19, 0.25)
    k, v = cache_rows(20, 2, 16)
    with pytest.raises(ValueError, match="T 1..16"):
        kernels.gqa_rows(queries(17, 4, 2, 16), k, v, 3, 0.25)


@pytest.mark.process
def test_the_same_bits_on_a_cpu_without_avx(tmp_path):
    """numba compiling for its "generic" CPU, in a process of its own: the same bits (no FMA is contracted, the
    vector sums are the code's)."""
    k, v = cache_rows(300, 3, 64)
    q = np.ascontiguousarray(queries(4, 9, 3, 64))
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v)
    code = ("import sys, numpy as np; from colichat.engine.gguf import kernels; d = np.load(sys.argv[1]); "
            "np.save(sys.argv[2], kernels.gqa_rows(d['q'], d['k'], d['v'], 296, 0.125))")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.npz"), str(tmp_path / "out.npy")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert got.returncode == 0, got.stderr
    here = kernels.gqa_rows(q, np.ascontiguousarray(k), np.ascontiguousarray(v), 296, 0.125)
    assert np.array_equal(here.view(np.uint32), np.load(tmp_path / "out.npy").view(np.uint32))
