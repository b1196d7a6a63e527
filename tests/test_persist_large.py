"""Loads past kvfile.PARALLEL_READ read with two threads: the same bytes, the same damage handling."""

from __future__ import annotations

import os

import numpy as np
from persist_helpers import IDENT, VOCAB

from colichat.engine.cache import KVCache
from colichat.persist import CacheLayout, Store, Turn
from colichat.persist.kvfile import PARALLEL_READ


def big_cache() -> tuple[KVCache, list[Turn]]:
    cache = KVCache("mla", 27, 512, 64, 4096)  # DeepSeek-V2-Lite's cache shape: 62,212 B per record
    n = 3 * PARALLEL_READ // cache.record_bytes  # ~24 MiB of records
    rng = np.random.default_rng(7)
    cache.records["token"][:n] = rng.integers(0, VOCAB, n)
    cache.records["kv"][:n] = rng.standard_normal(cache.records["kv"][:n].shape, dtype=np.float32)
    cache.set_length(n)
    cut = [0, n // 3, n // 2 + 1, n]
    turns = [Turn(("user", "assistant")[i % 2], f"t{i}", cut[i], cut[i + 1]) for i in range(3)]
    return cache, turns


def test_large_resume_is_byte_identical(colichat_home):
    cache, turns = big_cache()
    layout = CacheLayout.from_cache(cache, VOCAB)
    with Store().create(IDENT, layout, name="big") as s:
        s.append(cache, turns)
    fresh = KVCache("mla", 27, 512, 64, 4096)
    with Store().open(IDENT, "big", layout) as s:
        res = s.load(fresh)
    n = turns[-1].last
    assert res.tokens == n and not res.warnings
    assert np.array_equal(fresh.records[:n].view(np.uint8), cache.records[:n].view(np.uint8))


def test_large_file_cut_in_the_second_half_keeps_whole_turns(colichat_home):
    cache, turns = big_cache()
    layout = CacheLayout.from_cache(cache, VOCAB)
    with Store().create(IDENT, layout, name="cut") as s:
        s.append(cache, turns)
        kv_path = s.kv_path
    size = os.path.getsize(kv_path)
    os.truncate(kv_path, size - cache.record_bytes // 2)  # the last record is cut mid-way
    fresh = KVCache("mla", 27, 512, 64, 4096)
    with Store().open(IDENT, "cut", layout) as s:
        res = s.load(fresh)
    assert res.tokens == turns[1].last and len(res.turns) == 2
    assert any("cut short" in w for w in res.warnings)
    n = turns[1].last
    assert np.array_equal(fresh.records[:n].view(np.uint8), cache.records[:n].view(np.uint8))
