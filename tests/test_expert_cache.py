"""The routed-expert cache (engine/ffn.py ExpertCache): a slab of fixed slots, eviction by use frequency
with aging, quantized bytes read without the memory map, and the default size's bound (model.py).

Exactness: greedy decoding gives the same tokens, logits and KV cache bytes whatever the cache holds.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2

import colichat.engine.model as model_mod
from colichat.engine import load
from colichat.engine.ffn import ExpertCache
from colichat.engine.gguf.tensors import Tensors, open_gguf

PROMPT = [5, 17, 42, 99, 123, 7, 64, 200, 33, 150, 11, 80]
STEPS = 24


def _tensors(name: str) -> Tensors:
    path = str(TINY / f"{name}.gguf")
    return Tensors(open_gguf(path), path)


def _expert_bytes(name: str) -> int:
    """f32 bytes of one routed expert of a tiny model (gate, up, down)."""
    d, f = _tensors(name).shape("blk.1.ffn_down_exps.weight")[1:]  # (X, D, F)
    return 3 * d * f * 4


def _greedy(name: str, mib: float, prefetch: bool = False, cache_dir=None):
    """Prefill PROMPT, then greedy-decode STEPS tokens: (model, token ids, every logit row, KV cache bytes)."""
    m = load(str(TINY / f"{name}.gguf"), n_ctx=64, expert_cache=mib, cache_dir=cache_dir,
             kernels="numpy")  # (the kernel path multiplies quantized experts in the map: no cache)
    if prefetch and m.experts.caching:  # (off by default: ExpertCache.__init__)
        m.experts.prefetcher = ThreadPoolExecutor(1, "test-prefetch")
    rows = [m.prefill(PROMPT)]  # (T, V)
    ids = []
    for _ in range(STEPS):
        ids.append(int(np.argmax(rows[-1][-1])))
        rows.append(m.decode(ids[-1])[None])
    return m, ids, np.concatenate(rows), m.cache.records[: m.cache.length].tobytes()


# --- exactness --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ds-v3", "ds-v2-lite", "ds-v3.q8_0"])
def test_greedy_tokens_logits_and_kv_bytes_are_identical_with_all_experts_one_slot_and_no_cache(name):
    one = 1.5 * _expert_bytes(name) / 2**20  # MiB: room for one expert, not two
    big, ids, logits, kv = _greedy(name, 64)
    small, ids1, logits1, kv1 = _greedy(name, one)
    none, ids0, logits0, kv0 = _greedy(name, 0)
    assert ids1 == ids and ids0 == ids
    assert logits1.tobytes() == logits.tobytes() and logits0.tobytes() == logits.tobytes()  # bit for bit
    assert kv1 == kv and kv0 == kv
    # what was compared: every expert kept; one slot, far too small (misses > experts used); no cache
    assert len(big.experts.entries) == big.experts.misses and big.experts.hits > 0
    assert len(small.experts.slab) == 1 and small.experts.caching and small.experts.misses > big.experts.misses
    assert not none.experts.caching and none.experts.hits == 0


@pytest.mark.parametrize("name", ["ds-v3", "ds-v2-lite"])
def test_prefetching_the_next_layers_experts_changes_no_bit(name):
    """Decode predicts each next layer's experts and fills them on a worker: with a cache of a few slots
    (predictions evict experts in use) and with a large one, the output is the one without prefetch."""
    for mib in (4.5 * _expert_bytes(name) / 2**20, 64):
        on, ids, logits, kv = _greedy(name, mib, prefetch=True)
        off, ids0, logits0, kv0 = _greedy(name, mib)
        assert ids == ids0 and logits.tobytes() == logits0.tobytes() and kv == kv0
        e = on.experts
        assert e.prefetched > 0 and off.experts.prefetched == 0 and not e.pending or all(
            f.done() for f in e.pending.values())
        assert 0 < e.predicted_right <= e.predictions  # (how often right: benchmarks/moe.py)


def test_a_warm_start_fills_the_most_used_experts_of_the_last_run_and_changes_no_bit(tmp_path):
    """A run keeps its experts' use counts beside the weights cache; the next start fills its free slots
    with the most used in the background. Decode that starts at once (racing the warmer, which takes
    slots the decode then finds filled or being filled) gives the bits of a cold start."""
    name, mib = "ds-v3", 4.5 * _expert_bytes("ds-v3") / 2**20  # 4 slots for 16 experts
    first, ids, logits, kv = _greedy(name, mib, cache_dir=tmp_path)
    assert first.experts.warmer is None and first.usage_entry is not None
    first.keep_expert_usage()
    saved = np.load(first.usage_entry / "usage.npy")
    assert saved.shape == (16,) and np.array_equal(saved, first.experts.counts.astype(np.float32))

    warm = load(str(TINY / f"{name}.gguf"), n_ctx=64, expert_cache=mib, cache_dir=tmp_path, kernels="numpy")
    warm.experts.warmer.join()
    top = np.argsort(-saved, kind="stable")[:4]
    x = warm.experts.n_expert
    assert warm.experts.warming == warm.experts.warmed == 4
    assert set(warm.experts.entries) == {(1 + k // x, k % x) for k in top.tolist()}
    assert warm.experts.misses == 0 and np.array_equal(warm.experts.counts, saved.astype(np.float64))

    again, ids1, logits1, kv1 = _greedy(name, mib, cache_dir=tmp_path)  # decoding while the warmer fills
    assert again.experts.warmer is not None
    assert ids1 == ids and logits1.tobytes() == logits.tobytes() and kv1 == kv
    again.experts.warmer.join()
    # never more misses than a cold start; fewer unless the decode won every race for the slots (a busy machine)
    assert again.experts.misses <= first.experts.misses


def test_every_answer_keeps_the_experts_use_counts_for_the_next_start(tmp_path):
    from colichat.conversation.chat import Conversation, Settings

    m = load(str(TINY / "ds-v3.gguf"), n_ctx=128, expert_cache=1, cache_dir=tmp_path)
    conv = Conversation(m, Settings(max_tokens=4), save=False)
    conv.ask("hello")
    kept = np.load(m.usage_entry / "usage.npy")
    assert kept.any() and np.array_equal(kept, m.experts.counts.astype(np.float32))
    conv.ask("and again")
    # the second answer's counts, as they stand after it (not a larger sum: every X L uses halve them all)
    again = np.load(m.usage_entry / "usage.npy")
    assert np.array_equal(again, m.experts.counts.astype(np.float32)) and not np.array_equal(again, kept)


def test_a_damaged_or_foreign_usage_file_is_ignored(tmp_path):
    path = str(TINY / "ds-v3.gguf")
    m = load(path, n_ctx=64, expert_cache=1, cache_dir=tmp_path)
    for bad in (b"not a numpy file", None):
        if bad is None:  # another model's shape
            np.save(m.usage_entry / "usage.npy", np.ones(7, dtype=np.float32))
        else:
            (m.usage_entry / "usage.npy").write_bytes(bad)
        again = load(path, n_ctx=64, expert_cache=1, cache_dir=tmp_path)
        assert again.experts.warmer is None and not again.experts.counts.any()
    m.usage_entry = tmp_path / "gone"  # the entry removed under a running model: the hint is lost, no error
    m.keep_expert_usage()
    assert not m.usage_entry.exists()


# --- the slab ------------------------------------------------------------------------------------------------


def test_a_miss_allocates_no_slab_memory():
    c = ExpertCache(_tensors("ds-v3"), [1, 2], 2 * _expert_bytes("ds-v3"))
    slab, address, shape = c.slab, c.slab.ctypes.data, c.slab.shape
    for l in (1, 2):
        for e in range(8):
            gate_up, down = c.get(l, e)
            assert np.shares_memory(gate_up, slab) and np.shares_memory(down, slab)
    assert c.misses == 16 and c.hits == 0
    assert c.slab is slab and c.slab.ctypes.data == address and c.slab.shape == shape == (2, shape[1])
    assert len(c.entries) == 2 and c.bytes == 2 * c.slot_bytes <= c.capacity


def test_a_slot_holds_the_experts_values():
    t = _tensors("ds-v3.q8_0")
    c = ExpertCache(t, [1, 2], 3 * _expert_bytes("ds-v3.q8_0"))
    for l, e in [(1, 3), (2, 7), (1, 0), (2, 3), (1, 3)]:
        gate_up, down = c.get(l, e)
        b = f"blk.{l}."
        want = np.concatenate([t.f32(b + "ffn_gate_exps.weight", expert=e), t.f32(b + "ffn_up_exps.weight", expert=e)])
        assert np.array_equal(gate_up, want) and np.array_equal(down, t.f32(b + "ffn_down_exps.weight", expert=e))


def test_below_one_expert_nothing_is_cached():
    c = ExpertCache(_tensors("ds-v3"), [1, 2], _expert_bytes("ds-v3") - 1)
    for _ in range(3):
        c.get(1, 0)
    assert not c.caching and c.misses == 3 and c.hits == 0 and c.entries == {} and c.bytes == 0
    assert len(c.slab) == c.fill_threads  # a scratch slot per filling thread


def test_the_slab_never_has_more_slots_than_the_model_has_experts():
    c = ExpertCache(_tensors("ds-v3"), [1, 2], 1 << 30)
    assert len(c.slab) == 16


# --- the policy ----------------------------------------------------------------------------------------------


def test_a_frequently_used_expert_survives_a_burst_of_one_off_experts_that_lru_would_evict_it_in():
    c = ExpertCache(_tensors("ds-v3"), [1, 2], 3 * _expert_bytes("ds-v3"))
    for _ in range(4):
        c.get(1, 0)  # the frequent one
    burst = [(1, e) for e in range(1, 8)] + [(2, 0)]
    for key in burst:  # more one-off experts than slots: plain LRU evicts (1, 0) at the third
        c.get(*key)
    assert len(burst) >= len(c.slab) and (1, 0) in c.entries
    hits = c.hits
    c.get(1, 0)
    assert c.hits == hits + 1


def test_aging_lets_a_once_frequent_expert_go_before_a_recently_frequent_one():
    c = ExpertCache(_tensors("ds-v3"), [1, 2], 2 * _expert_bytes("ds-v3"))
    for _ in range(40):
        c.get(1, 0)  # frequent long ago
    for _ in range(30):
        c.get(1, 1)  # frequent lately, fewer uses in all than (1, 0)
    c.get(2, 5)  # a miss: one of the two goes
    assert c.aging < 70  # counts were halved on the way: without it (1, 0)'s 40 uses would keep it over (1, 1)'s 30
    assert (1, 1) in c.entries and (1, 0) not in c.entries and (2, 5) in c.entries


# --- file pages ------------------------------------------------------------------------------------------------


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("this kernel reports no RssFile in /proc/self/status (Linux 4.5 and later do): the file "
                "pages this test counts cannot be seen here")


def test_reading_every_expert_leaves_no_file_pages_resident(tmp_path):
    spec = DS2Spec(n_layer=2, n_dense=0, n_embd=512, n_head=2, q_lora_rank=0, kv_lora_rank=64, qk_nope=32,
                   qk_rope=32, v_head=32, n_expert=32, n_expert_used=2, n_expert_shared=0, n_ff_exp=512, gating=1,
                   probs_bias=False, n_group=0, weights_norm=False, weights_scale=1.0, qtype="Q8_0", raw_quant=True)
    path = str(write_deepseek2(tmp_path / "experts.gguf", spec))
    t = Tensors(open_gguf(path), path)
    exps = [n for n in t.by_name if "_exps." in n]
    quantized = sum(t.nbytes(n) for n in exps)  # ~53 MB
    c = ExpertCache(t, [0, 1], 0)
    before = _rss_file()
    for l in (0, 1):
        for e in range(32):
            c.get(l, e)
    grown = _rss_file() - before
    assert c.misses == 64 and grown < quantized // 8, (grown, quantized)
    before = _rss_file()  # the same bytes through the memory map do stay resident: the measure sees them
    for n in exps:
        np.bitwise_or.reduce(t.by_name[n].data.reshape(-1)[::1024])
    assert _rss_file() - before > quantized * 3 // 4


# --- the default size ------------------------------------------------------------------------------------------


def test_the_default_expert_cache_is_the_least_of_half_the_free_memory_and_the_file_less_the_dense_weights():
    gib, auto = 1 << 30, model_mod.auto_expert_cache_mib
    assert auto(64 * gib, 5 * gib, 6 * gib) == 6 * 1024  # the file's room bounds it on a large machine
    assert auto(12 * gib, 6 * gib, 6 * gib) == 3 * 1024  # half of the free memory on a small one
    assert auto(None, 5 * gib, 6 * gib) == model_mod.DEFAULT_EXPERT_CACHE_MIB  # memory unknown: the fixed default
    assert auto(64 * gib, 5 * gib, -gib) == model_mod.EXPERT_CACHE_MIN_MIB  # dense f32 above the file: the floor
    assert auto(None, 5 * gib) is None


def test_load_bounds_the_default_cache_by_the_file_size_and_an_explicit_size_wins(monkeypatch):
    path = str(TINY / "ds-v3.gguf")  # F32 experts: the file exceeds the dense f32 weights
    monkeypatch.setattr(model_mod, "available_memory", lambda: 64 << 30)
    monkeypatch.setattr(model_mod, "EXPERT_CACHE_MIN_MIB", 0)
    m = load(path, n_ctx=64)
    room = model_mod.gguf_bytes(m.tensors) - m.weight_bytes
    assert 0 < room and m.experts.capacity == room
    assert load(path, n_ctx=64, expert_cache=1).experts.capacity == 1 << 20


def test_the_memory_estimate_counts_the_scratch_slots_of_a_cache_of_nothing():
    m = load(str(TINY / "ds-v3.gguf"), n_ctx=64, expert_cache=0)
    assert m.memory_estimate().experts == m.experts.slab.nbytes == m.experts.fill_threads * _expert_bytes("ds-v3")


def test_a_fill_cut_short_leaves_no_expert_with_wrong_values(monkeypatch):
    t = _tensors("ds-v3")
    c = ExpertCache(t, [1, 2], 2 * _expert_bytes("ds-v3"))
    c.get(1, 0), c.get(1, 1)
    preadv, reads = os.preadv, []

    def interrupted(*args):  # a miss reads each part of the expert with preadv, then writes it into the slot
        reads.append(1)
        if len(reads) == 2:
            raise KeyboardInterrupt  # after the first part of the expert was written over the victim's slot
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.get(2, 3)
    monkeypatch.undo()
    assert (2, 3) not in c.entries and len(c.entries) == 1
    for (l, e), (gate_up, _) in c.entries.items():
        assert np.array_equal(gate_up[: gate_up.shape[0] // 2], t.f32(f"blk.{l}.ffn_gate_exps.weight", expert=e))
    gate_up, down = c.get(2, 3)
    assert np.array_equal(down, t.f32("blk.2.ffn_down_exps.weight", expert=3))
