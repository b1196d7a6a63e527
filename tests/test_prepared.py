"""The disk cache of dequantized weights: a later start maps them and computes the same logits."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY
from gguf_factory import DS2Spec, write_deepseek2

from colichat.engine import load
from colichat.engine.gguf.prepared import load_prepared

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


def _memory_mapped(a: np.ndarray) -> bool:
    """Whether the array's memory belongs to a memory mapping (following its chain of bases)."""
    import mmap

    obj = a
    while obj is not None:
        if isinstance(obj, mmap.mmap):
            return True
        obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
    return False


def test_lazy_experts_are_mapped_from_the_gguf(tmp_path):
    """Routed experts are not dequantized at load (neither on the first start nor from the weights
    cache): their tensors are the GGUF's quantized bytes in its memory mapping, and an expert is
    dequantized from those bytes when a token is routed to it."""
    import gguf as gguf_py

    path = write_deepseek2(tmp_path / "moe.gguf", DS2Spec(n_expert=8, n_expert_used=2, qtype="Q8_0"))
    cache = tmp_path / "weights"
    reader = gguf_py.GGUFReader(str(path))  # an independent reading of the file
    logits = []
    for start in ("first", "from the weights cache"):
        model = load(str(path), n_ctx=64, cache_dir=cache, kernels="numpy")  # (the expert cache's path)
        exps = [n for n in model.tensors.by_name if "_exps." in n]
        assert exps and not [n for n in model.w if "_exps" in n], start  # not among the dequantized weights
        for name in exps:
            data = model.tensors.by_name[name].data
            assert data.dtype == np.uint8 and _memory_mapped(data) and not data.flags.writeable, (start, name)
            with open(model.tensors.files[name], "rb") as f:  # the mapping is the file at the tensor's offset
                f.seek(model.tensors.offsets[name])
                assert f.read(4096) == data.reshape(-1)[:4096].tobytes(), (start, name)
        assert model.experts.entries == {} and model.experts.misses == 0  # nothing dequantized at load
        logits.append(_logits(model))
        assert model.experts.misses > 0 and model.experts.entries  # dequantized on use
        for (layer, e), (_, down) in model.experts.entries.items():
            t = next(t for t in reader.tensors if t.name == f"blk.{layer}.ffn_down_exps.weight")
            want = gguf_py.quants.dequantize(t.data[e], t.tensor_type)
            assert np.array_equal(down, want.reshape(down.shape)), (start, layer, e)
    assert np.array_equal(*logits)
    meta = _meta(next(cache.iterdir()))
    assert not [n for n in meta["arrays"] if "_exps" in n]  # the cache holds no dequantized experts


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


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _meta(entry):
    return json.loads((entry / "meta.json").read_bytes().partition(b"\n")[2])


def _middle_of_largest_array(entry):
    off, shape = max(_meta(entry)["arrays"].values(), key=lambda a: np.prod(a[1]))[:2]
    return off + 4 * int(np.prod(shape)) // 2


def _edit_meta_json(entry):  # still valid JSON, one offset moved by 64 bytes: would load wrong weights
    raw = (entry / "meta.json").read_bytes()
    name = next(iter(_meta(entry)["arrays"]))
    off = _meta(entry)["arrays"][name][0]
    key = f'"{name}": [{off},'.encode()
    (entry / "meta.json").write_bytes(raw.replace(key, f'"{name}": [{off + 64},'.encode(), 1))


DAMAGE = {
    "meta-json-text": (lambda e: (e / "meta.json").write_text("{not json"), "meta.json: does not match"),
    "meta-json-value": (_edit_meta_json, "meta.json: does not match its checksum"),
    "weights-cut": (lambda e: os.truncate(e / "weights.f32", os.path.getsize(e / "weights.f32") - 4096),
                    "weights.f32 holds"),
    "weights-empty": (lambda e: os.truncate(e / "weights.f32", 0), "weights.f32 holds 0 bytes"),
    "weights-bit": (lambda e: _flip(e / "weights.f32", _middle_of_largest_array(e)), "does not match its checksum"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_entry_is_rebuilt_with_a_note(kind, tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    good = _logits(load(str(gguf), n_ctx=64, cache_dir=cache))
    (entry,) = cache.iterdir()
    damage, why = DAMAGE[kind]
    damage(entry)
    notes = []
    again = load(str(gguf), n_ctx=64, cache_dir=cache, on_note=notes.append)
    assert np.array_equal(_logits(again), good)
    assert len(notes) == 2 and notes[0].startswith(f"the dequantized-weights cache {entry} was damaged (")
    assert why in notes[0] and notes[0].endswith("; dequantizing again")
    assert notes[1].startswith("kept the dequantized weights")  # prepared anew and written again
    notes.clear()
    mapped = load(str(gguf), n_ctx=64, cache_dir=cache, on_note=notes.append)  # rewritten: used again
    assert notes == []
    assert np.array_equal(_logits(mapped), good)


def test_large_entries_are_checked_by_samples_of_every_array(tmp_path, monkeypatch):
    """Past FULL_CHECK_BYTES a start checks three pieces of each array: a flip inside one is caught,
    and the check reads a small part of the file."""
    from colichat.engine.gguf import prepared

    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    load(str(gguf), n_ctx=64, cache_dir=cache)
    monkeypatch.setattr(prepared, "FULL_CHECK_BYTES", 0)
    assert load_prepared(str(gguf), cache) is not None
    (entry,) = cache.iterdir()
    _flip(entry / "weights.f32", _middle_of_largest_array(entry))
    notes = []
    assert load_prepared(str(gguf), cache, notes.append) is None
    assert "does not match its checksum" in notes[0]


def test_entry_is_fsynced_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    from colichat.engine.gguf import prepared

    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def rename(a, b):
        events.append(("rename", os.path.basename(b)))
        real_rename(a, b)

    monkeypatch.setattr(prepared.os, "fsync", fsync)
    monkeypatch.setattr(prepared.os, "rename", rename)
    load(str(gguf), n_ctx=64, cache_dir=cache)
    (entry,) = cache.iterdir()
    assert events[-1] == ("fsync", "weights")  # the directory holding the new name
    done = events[: events.index(("rename", entry.name))]
    assert {("fsync", "weights.f32"), ("fsync", "meta.json")} <= set(done)
    assert done[-1][1].startswith(".tmp-")  # the entry's directory, last before the rename


def test_an_entry_another_start_put_in_place_first_is_used_not_a_failure(tmp_path, monkeypatch):
    """Starts of one model at once: the entry another start renamed into place while this one was
    dequantizing is as good as this one's: no 'cannot write' note, one entry, no temporary left."""
    from colichat.engine.gguf import prepared

    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    theirs = tmp_path / "theirs"
    load(str(gguf), n_ctx=64, cache_dir=theirs)
    (made,) = theirs.iterdir()
    real_rename = os.rename

    def rename(a, b):  # the other start renames its entry into place just before this one does
        if Path(b).name == made.name and not Path(b).exists():
            shutil.copytree(made, b)
        real_rename(a, b)

    monkeypatch.setattr(prepared.os, "rename", rename)
    cache, notes = tmp_path / "weights", []
    load(str(gguf), n_ctx=64, cache_dir=cache, on_note=notes.append)
    assert notes == [f"kept the dequantized weights (9 MiB) in {cache}; later starts map them instead of "
                     "dequantizing"]
    assert [p.name for p in cache.iterdir()] == [made.name]
    assert load_prepared(str(gguf), cache) is not None


def test_an_entry_in_the_way_that_a_start_cannot_use_is_replaced(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    load(str(gguf), n_ctx=64, cache_dir=cache)
    (entry,) = cache.iterdir()
    (entry / "weights.f32").unlink()  # load_prepared cannot use it (and leaves it)
    notes = []
    load(str(gguf), n_ctx=64, cache_dir=cache, on_note=notes.append)
    assert notes[0].startswith("kept the dequantized weights") and len(notes) == 1
    assert [p.name for p in cache.iterdir()] == [entry.name] and load_prepared(str(gguf), cache) is not None


KILLED_WRITER = """
import os, sys, time
sys.path.insert(0, {tests!r})
from colichat.engine import load
from colichat.engine.gguf import prepared
real = os.fsync
def stall(fd):  # the entry is half written in its temporary directory: say so, wait for the kill
    print("writing", flush=True)
    time.sleep(600)
prepared.os.fsync = stall
load({gguf!r}, n_ctx=64, cache_dir={cache!r})
"""


@pytest.mark.process
def test_a_first_start_killed_while_writing_leaves_no_temporary_directory(tmp_path):
    import signal
    import subprocess
    import sys

    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    script = KILLED_WRITER.format(tests=str(Path(__file__).parent), gguf=str(gguf), cache=str(cache))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "writing\n"
    child.send_signal(signal.SIGKILL)
    child.wait(60)
    [tmp] = cache.iterdir()
    assert tmp.name.startswith(f".tmp-{child.pid}-") and (tmp / "weights.f32").stat().st_size > 0
    load(str(gguf), n_ctx=64, cache_dir=cache)  # the next start
    [entry] = cache.iterdir()
    assert not entry.name.startswith(".tmp-") and load_prepared(str(gguf), cache) is not None


def test_a_temporary_directory_of_a_running_start_is_left_alone(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    cache = tmp_path / "weights"
    cache.mkdir()
    busy = cache / f".tmp-{os.getppid()}-abc"  # pytest's parent runs: as another start still writing
    busy.mkdir()
    load(str(gguf), n_ctx=64, cache_dir=cache)
    assert busy.is_dir() and len(list(cache.iterdir())) == 2


def test_unwritable_cache_dir_is_only_a_note(tmp_path):
    gguf = tmp_path / "llama.gguf"
    shutil.copy(TINY / "llama.gguf", gguf)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    notes = []
    model = load(str(gguf), n_ctx=64, cache_dir=blocker / "weights", on_note=notes.append)
    assert model.prefill(IDS).shape == (len(IDS), model.cfg.n_vocab)
    assert notes == [f"cannot write the weights cache in {blocker / 'weights'} (Not a directory); "
                     "each start dequantizes instead"]


def test_no_cache_written_when_the_disk_is_nearly_full(tmp_path, monkeypatch):
    import collections

    from colichat.engine.gguf import prepared

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
    from colichat.errors import ModelError

    monkeypatch.setattr(engine, "available_memory", lambda: 1 << 20)  # 1 MiB free
    with pytest.raises(ModelError, match="GiB as f32"):
        load(str(TINY / "llama.gguf"), n_ctx=64)


def test_a_model_given_by_a_link_keeps_the_link_as_its_path_when_mapped_from_the_cache(tmp_path):
    """The second start through a link maps the weights kept for the file it leads to, and its config
    names the link, as the first start's does (sessions record it: model.path, beside model.real_path)."""
    shutil.copy(TINY / "llama.gguf", tmp_path / "llama.gguf")
    link = tmp_path / "cur.gguf"
    link.symlink_to("llama.gguf")
    cache = tmp_path / "weights"
    first = load(str(link), n_ctx=64, cache_dir=cache)
    second = load(str(link), n_ctx=64, cache_dir=cache)
    assert not second.w["token_embd"].flags.writeable  # mapped from the cache
    assert first.cfg.path == second.cfg.path == str(link)


def test_a_model_given_by_a_relative_path_maps_its_own_experts_from_any_directory(tmp_path, monkeypatch):
    """The entry records the file its quantized tensors (the routed experts) are mapped from as a real
    path: given relatively at the first start, the same file reached from another directory maps its
    own tensors, never those of whatever that relative path names there."""
    for d, seed in (("a", 1), ("b", 2)):  # same shapes, other weights, at the same relative path
        (tmp_path / d).mkdir()
        write_deepseek2(tmp_path / d / "model.gguf", DS2Spec(n_expert=8, n_expert_used=2, qtype="Q8_0", seed=seed))
    cache = tmp_path / "weights"
    monkeypatch.chdir(tmp_path / "a")
    first = _logits(load("model.gguf", n_ctx=64, cache_dir=cache))
    monkeypatch.chdir(tmp_path / "b")
    again = load("../a/model.gguf", n_ctx=64, cache_dir=cache)
    assert not again.w["output_norm"].flags.writeable  # from the cache entry
    assert np.array_equal(_logits(again), first)


def test_the_sampling_defaults_a_model_file_carries_are_the_defaults(tmp_path):
    """general.sampling.* (as the model's makers set them): the defaults of the settings no option
    gives, said in a note; an option wins; a value a setting cannot take is left out."""
    from cli_helpers import TINY_LLAMA, copy_gguf

    from colichat.conversation.settings import Settings
    from colichat.engine import load
    from colichat.terminal.start import model_sampling

    path = copy_gguf(TINY_LLAMA, tmp_path / "s.gguf", set_keys={
        "general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 7.0})
    cfg = load(path, n_ctx=64, cache_dir=tmp_path / "c").cfg
    assert dict(cfg.sampling) == {"temperature": pytest.approx(0.6), "top_k": 20, "top_p": 7.0}
    again = load(path, n_ctx=64, cache_dir=tmp_path / "c").cfg  # mapped from the prepared cache
    assert again.sampling == cfg.sampling
    settings, note = model_sampling(Settings(), frozenset({"top_k"}), cfg)
    assert settings.temperature == 0.6 and settings.top_k == 40 and settings.top_p == 0.95  # 7: not a top_p
    assert note == "note: the model's own sampling defaults: temperature 0.6 (/set or an option changes them)"
    assert model_sampling(Settings(), frozenset(), load(TINY_LLAMA, n_ctx=64).cfg) == (Settings(), None)
