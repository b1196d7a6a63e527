"""The thread policy: a product's row blocks are fixed by its shape, so one thread or several (and
however the blocks fall to them) give the same bits, for ops.linear and for whole models."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import TINY
from threadpoolctl import threadpool_info, threadpool_limits

from colichat.engine import load, ops
from colichat.engine.ops import ROW_ALIGN, ROW_BLOCKS, SMALL_BATCH, WORKERS, linear, row_blocks
from colichat.engine.threads import PROBE_EVERY, PROBE_MAX, Faster, ThreadPolicy, Workers

TINY_MODELS = ["llama", "ds-v2-lite", "ds-dense", "ds-v3", "plm", "minicpm3"]


@pytest.mark.parametrize("o", [1, 15, 16, 40, 127, 576, 960, 3072, 49152])
def test_row_blocks_cover_the_outputs_on_aligned_edges(o):
    e = row_blocks(o)
    assert e[0] == 0 and e[-1] == o and all(a < b for a, b in zip(e[:-1], e[1:], strict=True))
    assert all(a % ROW_ALIGN == 0 for a in e[:-1])
    assert len(e) - 1 == max(1, min(ROW_BLOCKS, o // ROW_ALIGN))


def linear_with(workers, x, w):
    token = WORKERS.set(workers)
    try:
        with threadpool_limits(1, "blas"):
            return linear(x, w)
    finally:
        WORKERS.reset(token)


@pytest.mark.parametrize("t", [1, 2, 9, SMALL_BATCH, SMALL_BATCH + 1, 200])
@pytest.mark.parametrize("o,z", [(576, 1536), (3072, 576), (100, 64), (8, 32)])
def test_linear_gives_the_same_bits_with_one_two_and_three_threads(t, o, z, monkeypatch):
    monkeypatch.setattr(ops, "MATVEC_SPLIT", 0)  # matrix-vector products of any size shared out too
    rng = np.random.default_rng(t * o + z)
    x = rng.standard_normal((t, z), dtype=np.float32)
    w = rng.standard_normal((o, z), dtype=np.float32)
    one = linear_with(None, x, w)
    two, three = Workers(2), Workers(3)
    for _ in range(3):  # the blocks fall to the threads differently from call to call
        assert np.array_equal(linear_with(two, x, w), one)
        assert np.array_equal(linear_with(three, x, w), one)
    assert np.allclose(one, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)
    if t <= SMALL_BATCH:  # every row is the matrix-vector product decode computes
        for i in range(t):
            assert np.array_equal(one[i], linear_with(None, x[i : i + 1], w)[0])


def test_blocks_are_handed_out_one_at_a_time():
    """While a helper is stuck in its first block, the calling thread computes all the others."""
    n, main = 8, threading.current_thread()
    computed, released = [], threading.Event()

    def compute(i):
        if threading.current_thread() is not main:
            assert released.wait(60)
        computed.append((i, threading.current_thread() is main))
        if sum(m for _, m in computed) >= n - 1:
            released.set()
        return i

    for _ in range(5):
        computed.clear()
        released.clear()
        stored = {}
        Workers(2).run(compute, stored.__setitem__, n)
        assert stored == {i: i for i in range(n)}
        assert sum(m for _, m in computed) >= n - 1


def test_a_descheduled_helper_does_not_hold_up_the_product():
    """A helper that never finishes its block: the calling thread computes that block too, run()
    returns with every block stored once, and the helper's late copy is dropped."""
    main, gate = threading.current_thread(), threading.Event()
    helper_started, helper_finished = threading.Event(), threading.Event()
    stores = []

    def compute(i):
        if threading.current_thread() is not main:
            helper_started.set()
            gate.wait(60)
            helper_finished.set()
            return -1  # a late copy: must not be stored
        assert helper_started.wait(60)  # let the helper take a block first
        return i

    workers = Workers(2)
    workers.run(compute, lambda i, y: stores.append((i, y)), 4)
    assert not helper_finished.is_set()  # returned while the helper was still in its block
    assert sorted(stores) == [(i, i) for i in range(4)]
    gate.set()
    assert helper_finished.wait(60)
    workers.pool.shutdown(wait=True)
    assert sorted(stores) == [(i, i) for i in range(4)]


def test_an_error_in_a_block_reaches_the_caller_and_the_workers_still_work():
    workers = Workers(2)

    def bad(i):
        if i == 3:
            raise ValueError("block 3")
        return i

    with pytest.raises(ValueError, match="block 3"):
        workers.run(bad, lambda i, y: None, 8)
    stored = {}
    workers.run(lambda i: i, stored.__setitem__, 8)
    assert stored == {i: i for i in range(8)}


def run_model(model, policy, prompt, toks):
    """Logits of a prompt (one pass), of decoding toks one by one and of a verify pass of them,
    with the cache bytes after each."""
    model.threads = policy
    model.reset()
    out = [model.prefill(prompt)]
    out += [model.decode(t) for t in toks]
    rows = bytes(model.cache.raw(0, model.cache.length))
    model.cache.truncate(len(prompt))
    out.append(model.prefill(toks))
    return out, rows, bytes(model.cache.raw(0, model.cache.length))


def assert_same_with_one_and_two_threads(model, n_prompt, monkeypatch):
    monkeypatch.setattr(ops, "MATVEC_SPLIT", 0)  # decode's matrix-vector products of any size shared out too
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, model.cfg.n_vocab, n_prompt).tolist()
    toks = rng.integers(0, model.cfg.n_vocab, 6).tolist()
    ref = run_model(model, ThreadPolicy(decode=1, prefill=1, one_token=(1,)), prompt, toks)
    try:
        for decode, prefill, one_token in ((1, 2, (1,)), (2, 2, (2,)), (2, 3, (3,))):
            got = run_model(model, ThreadPolicy(decode, prefill, one_token), prompt, toks)
            assert all(np.array_equal(a, b) for a, b in zip(got[0], ref[0], strict=True))
            assert got[1:] == ref[1:]
    finally:
        model.threads = ThreadPolicy()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_logits_and_cache_are_the_same_with_one_and_two_threads(name, monkeypatch):
    assert_same_with_one_and_two_threads(load(str(TINY / f"{name}.gguf"), n_ctx=256), 40, monkeypatch)


def test_smollm2_logits_and_cache_are_the_same_with_one_and_two_threads(default_model, monkeypatch):
    assert_same_with_one_and_two_threads(default_model, 100, monkeypatch)


def run_faster(faster, seconds, passes: int) -> list[int]:
    """The thread counts Faster picks for `passes` passes whose times are seconds[n]."""
    picked = []
    for _ in range(passes):
        n = faster.pick()
        faster.record(n, seconds[n])
        picked.append(n)
    return picked


def test_one_token_passes_take_the_faster_thread_count():
    faster = Faster((1, 2))
    picked = run_faster(faster, {1: 0.040, 2: 0.027}, 200)
    assert picked[:2] == [1, 2] and faster.best == 2
    assert picked[2:].count(1) == 3  # tried again after 16, 32 and 64 passes, losing each time


def test_a_thread_count_that_keeps_losing_is_tried_ever_less_often():
    faster = Faster((1, 2))
    picked = run_faster(faster, {1: 0.040, 2: 0.100}, 3000)
    tries = [i for i, n in enumerate(picked) if n == 2]
    gaps = np.diff(tries)
    assert faster.best == 1 and gaps[0] == PROBE_EVERY
    assert all(b == min(2 * a, PROBE_MAX) for a, b in zip(gaps[:-1], gaps[1:], strict=True))  # doubling
    assert len(tries) < 20  # of 3000 passes: the tries cost under 1% here


def test_a_core_taken_mid_answer_sends_one_token_passes_back_to_one_thread():
    faster = Faster((1, 2))
    run_faster(faster, {1: 0.040, 2: 0.027}, 500)
    assert faster.best == 2
    picked = run_faster(faster, {1: 0.045, 2: 0.100}, 3)  # another process takes a core
    assert picked == [2, 1, 1] and faster.best == 1
    faster = Faster((1, 2))
    run_faster(faster, {1: 0.040, 2: 0.027}, 500)
    picked = run_faster(faster, {1: 0.060, 2: 0.100}, 3)  # one thread slower too than two were before
    assert picked == [2, 1, 1] and faster.best == 1


def test_a_core_freed_again_is_used_within_probe_max_passes():
    faster = Faster((1, 2))
    run_faster(faster, {1: 0.045, 2: 0.100}, 2000)
    assert faster.best == 1
    picked = run_faster(faster, {1: 0.040, 2: 0.027}, PROBE_MAX + 1)
    assert faster.best == 2 and picked[-1] == 2


def blas_threads() -> int:
    return threadpool_info()[0]["num_threads"]


class Spy(np.ndarray):
    """An array that records the OpenBLAS thread count whenever a ufunc (a product) reads it."""

    seen: list[int] = []

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        Spy.seen.append(blas_threads())
        inputs = tuple(np.asarray(a) for a in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(a) for a in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)


def test_a_decode_pass_runs_its_matrix_vector_products_alone_on_openblas_threads():
    """On two threads, a one-token pass's ops.linear sees two OpenBLAS threads and every other BLAS
    call of the pass one (OpenBLAS's matrix products, attention's, round differently with two)."""
    Spy.seen = []
    x, w = np.ones((1, 8), np.float32), np.ones((64, 8), np.float32)
    with ThreadPolicy(one_token=(2,)).limit(1):
        before = blas_threads()
        assert ops.linear(x, w.view(Spy)).tolist() == [[8.0] * 64]
        after = blas_threads()
    with ThreadPolicy(one_token=(1,)).limit(1):
        ops.linear(x, w.view(Spy))
    assert (before, Spy.seen, after) == (1, [2, 1], 1)


@pytest.mark.parametrize("o", [2820, 1004, 3072])
@pytest.mark.parametrize("n", [2, 3])
def test_any_number_of_outputs_gives_one_threads_bits_on_openblas_threads(o, n):
    """OpenBLAS's kernel computes outputs in groups: a thread's share that ended inside a group would
    round differently; BlasMatvec's shares are whole groups (2820 and 1004 outputs do not divide evenly)."""
    rng = np.random.default_rng(o + n)
    w = rng.standard_normal((o, 2048), dtype=np.float32)  # large enough for OpenBLAS to use its threads
    x = rng.standard_normal((3, 2048), dtype=np.float32)
    with ThreadPolicy(one_token=(1,)).limit(1):
        one = [ops.linear(x[i : i + 1], w)[0] for i in range(3)]
    policy = ThreadPolicy(one_token=(n,))
    with policy.limit(1):
        assert np.array_equal(ops.linear(x[:1], w)[0], one[0])
    with policy.limit(3):
        assert np.array_equal(ops.linear(x, w), np.stack(one))


def test_a_verify_pass_runs_its_matrix_vector_products_on_openblas_threads_with_decode_bits():
    """On two threads, each row of a pass of 2..SMALL_BATCH tokens is computed by matrix-vector products
    on two OpenBLAS threads (per block of ops.SHARED_BLOCK bytes of weights): bit for bit the row a
    one-token pass gives."""
    Spy.seen = []
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3072, 576), dtype=np.float32)  # 7 MB: two blocks, each split by OpenBLAS
    x = rng.standard_normal((5, 576), dtype=np.float32)
    policy = ThreadPolicy(one_token=(2,))
    with policy.limit(5):
        rows = ops.linear(x, w.view(Spy))
    assert Spy.seen == [2] * 10  # 2 blocks x 5 rows
    for i in range(5):
        with policy.limit(1):
            assert np.array_equal(rows[i], ops.linear(x[i : i + 1], w)[0])
        with ThreadPolicy(one_token=(1,)).limit(1):
            assert np.array_equal(rows[i], ops.linear(x[i : i + 1], w)[0])
