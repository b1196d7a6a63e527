"""The disk cache of dequantized weights: a later start maps them and computes the same logits."""

from __future__ import annotations

import os
import shutil

import numpy as np
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2

from colichat.engine import load
from colichat.engine.prepared import load_prepared

IDS = [5, 17, 200, 33, 91, 64, 7, 250]


def _logits(model):
    model.reset()
    return model.prefill(IDS)


def test_second_load_maps_cached_weights_and_agrees(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    first = load(str(gguf), n_ctx=64, cache_dir=cache)
    assert load_prepared(str(gguf), cache) is not None
    second = load(str(gguf), n_ctx=64, cache_dir=cache)
    assert not second.w["token_embd"].flags.writeable  # mapped from the cache, not dequantized again
    assert np.array_equal(_logits(first), _logits(second))
    assert second.tokenizer.encode("hello there") == first.tokenizer.encode("hello there")
    assert second.cfg == first.cfg


def test_lazy_experts_are_mapped_from_the_gguf(tmp_path):
    gguf = write_deepseek2(tmp_path / "moe.gguf", DS2Spec(n_expert=8, n_expert_used=2, qtype="Q8_0"))
    cache = tmp_path / "weights"
    first = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    again = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    assert np.array_equal(first, again)


def test_changed_gguf_invalidates_the_entry(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_deepseek2(gguf, DS2Spec(seed=1))
    cache = tmp_path / "weights"
    a = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    write_deepseek2(gguf, DS2Spec(seed=2))  # same shapes, other weights
    os.utime(gguf, ns=(1, 1))
    assert load_prepared(str(gguf), cache) is None
    b = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    assert not np.array_equal(a, b)
    assert len([p for p in cache.iterdir()]) == 1  # the stale entry was removed


def test_damaged_entry_is_rebuilt(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    good = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    (entry,) = cache.iterdir()
    (entry / "meta.json").write_text("{not json")
    assert load_prepared(str(gguf), cache) is None
    assert np.array_equal(_logits(load(str(gguf), n_ctx=64, cache_dir=cache)), good)


def test_unwritable_cache_dir_is_only_a_note(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    notes = []
    model = load(str(gguf), n_ctx=64, cache_dir=blocker / "weights", on_note=notes.append)
    assert model.prefill(IDS).shape == (len(IDS), model.cfg.n_vocab)
    assert len(notes) == 1 and "weights cache" in notes[0]


def test_no_cache_written_when_the_disk_is_nearly_full(tmp_path, monkeypatch):
    import collections

    from colichat.engine import prepared

    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(prepared.shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, 100 << 20))
    notes = []
    load(str(gguf), n_ctx=64, cache_dir=tmp_path / "weights", on_note=notes.append)
    assert len(notes) == 1 and "free" in notes[0]
    assert load_prepared(str(gguf), tmp_path / "weights") is None


def test_a_model_too_big_for_memory_is_refused_before_dequantizing(tmp_path, monkeypatch):
    import pytest

    from colichat import engine
    from colichat.engine.gguf import ModelError

    monkeypatch.setattr(engine, "available_memory", lambda: 1 << 20)  # 1 MiB free
    with pytest.raises(ModelError, match="GiB as f32"):
        load(str(TINY / "llama.gguf"), n_ctx=64)
