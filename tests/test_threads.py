"""The thread policy: a product's row blocks are fixed by its shape, so one thread or several (and
however the blocks fall to them) give the same bits, for ops.linear and for whole models."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import TINY
from threadpoolctl import threadpool_limits

from colichat.engine import load
from colichat.engine.ops import ROW_ALIGN, ROW_BLOCKS, SMALL_BATCH, WORKERS, linear, row_blocks
from colichat.engine.threads import ThreadPolicy, Workers

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
def test_linear_gives_the_same_bits_with_one_two_and_three_threads(t, o, z):
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


def test_a_stuck_thread_holds_up_one_block_only():
    """Blocks are handed out one at a time: while a helper is stuck in its first block, the calling
    thread computes all the others."""
    n, main = 8, threading.current_thread()
    done, released = [], threading.Event()

    def block(i):
        if threading.current_thread() is not main:
            assert released.wait(60)
        done.append((i, threading.current_thread() is main))
        if sum(m for _, m in done) == n - 1:
            released.set()

    for _ in range(5):
        done.clear()
        released.clear()
        Workers(2).run(block, n)
        assert sorted(i for i, _ in done) == list(range(n))
        assert sum(m for _, m in done) >= n - 1


def test_an_error_in_a_block_reaches_the_caller_and_the_workers_still_work():
    workers = Workers(2)

    def bad(i):
        if i == 3:
            raise ValueError("block 3")

    with pytest.raises(ValueError, match="block 3"):
        workers.run(bad, 8)
    seen = []
    workers.run(seen.append, 8)
    assert sorted(seen) == list(range(8))


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


def assert_same_with_one_and_two_threads(model, n_prompt):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, model.cfg.n_vocab, n_prompt).tolist()
    toks = rng.integers(0, model.cfg.n_vocab, 6).tolist()
    ref = run_model(model, ThreadPolicy(decode=1, prefill=1), prompt, toks)
    try:
        for decode, prefill in ((1, 2), (2, 2), (2, 3)):
            got = run_model(model, ThreadPolicy(decode=decode, prefill=prefill), prompt, toks)
            assert all(np.array_equal(a, b) for a, b in zip(got[0], ref[0], strict=True))
            assert got[1:] == ref[1:]
    finally:
        model.threads = ThreadPolicy()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_model_logits_and_cache_are_the_same_with_one_and_two_threads(name):
    assert_same_with_one_and_two_threads(load(str(TINY / f"{name}.gguf"), n_ctx=256), 40)


def test_smollm2_logits_and_cache_are_the_same_with_one_and_two_threads(default_model):
    assert_same_with_one_and_two_threads(default_model, 100)
