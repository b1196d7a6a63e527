"""Damaged, hostile or foreign session files: a clear one-line refusal or a clean partial load of
whole turns, never a crash, and never a modified file (bytes and mtime compared before/after)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from persist_helpers import IDENT, OTHER_IDENT, build, layout_of, make_cache, plan, snapshot

import colichat.persist.kvfile as kvfile
from colichat.persist import SessionError, Store

RB = make_cache("mla").record_bytes
N_TURNS = 5


@pytest.fixture
def saved(colichat_home):
    """A session 'd' of 5 turns; returns (store, directory, turns, cache with those records)."""
    cache = make_cache("mla")
    turns = build(cache, N_TURNS)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="d") as sess:
        sess.append(cache, turns)
    return store, store.model_dir(IDENT), turns, cache


def load(store, name="d", ident=IDENT, **kw):
    """Load into a fresh cache; assert the files did not change whatever happened."""
    directory = store.model_dir(ident)
    before = snapshot(directory)
    cache = make_cache("mla")
    pristine = cache.records.copy()
    try:
        with store.open(ident, name, layout_of(cache)) as sess:
            res = sess.load(cache, **kw)
    except SessionError as e:
        assert "\n" not in str(e) and str(e)
        assert np.array_equal(cache.records, pristine) and cache.length == 0  # refusals touch nothing
        raise
    finally:
        assert snapshot(directory) == before
    return res, cache


def check_prefix(res, cache, turns, original, n_kept):
    assert res.turns == turns[:n_kept]
    n = turns[n_kept - 1].last if n_kept else 0
    assert res.tokens == n == cache.length
    assert cache.raw(0, n).tobytes() == original.raw(0, n).tobytes()


def patch_file(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("content,word", [
    (b"", "empty"),
    (b"COLIKV1\0\x03\0", "truncated header"),
    (b"GGUF" + bytes(100), "magic"),
    (bytes(range(256)) * 20, "magic"),
    (b"COLIKV1\0" + struct.pack("<8i", 3, 16, 4, 0, 0, 1000, -5, 0), "damaged header"),
])
def test_garbage_kv_file_is_refused(saved, content, word):
    store, directory, _, _ = saved
    (directory / "d.coli_kv").write_bytes(content)
    with pytest.raises(SessionError, match=word):
        load(store)


def test_huge_nrec_keeps_what_the_file_holds(saved):
    store, directory, turns, original = saved
    patch_file(directory / "d.coli_kv", kvfile.NREC_OFFSET, struct.pack("<i", 2**31 - 1))
    res, cache = load(store)
    check_prefix(res, cache, turns, original, N_TURNS)
    assert any("cut short" in w for w in res.warnings)


def test_bit_flip_in_records_drops_that_turn_and_later(saved):
    store, directory, turns, original = saved
    offset = 40 + (turns[2].first + 1) * RB - 7  # inside turn 3's records
    data = bytearray((directory / "d.coli_kv").read_bytes())
    patch_file(directory / "d.coli_kv", offset, bytes([data[offset] ^ 0x10]))
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 2)
    assert len(res.warnings) == 1 and "checksum" in res.warnings[0] and "turns 3-5" in res.warnings[0]


def test_bit_flip_in_header_is_refused(saved):
    store, directory, _, _ = saved
    patch_file(directory / "d.coli_kv", 8, struct.pack("<i", 3 ^ 0x40))
    with pytest.raises(SessionError, match="another model"):
        load(store)


def test_file_cut_mid_record(saved):
    store, directory, turns, original = saved
    os.truncate(directory / "d.coli_kv", 40 + turns[3].first * RB + RB // 2)
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 3)
    assert any("cut short" in w for w in res.warnings) and any("turns 4-5" in w for w in res.warnings)


def test_sidecar_listing_turns_past_nrec(saved):
    store, directory, turns, original = saved
    patch_file(directory / "d.coli_kv", kvfile.NREC_OFFSET, struct.pack("<i", turns[1].last + 3))
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 2)
    assert any("turns 3-5" in w for w in res.warnings)  # listed past nrec
    assert any("3 records after the last turn" in w for w in res.warnings)  # records not in a turn


def test_records_past_nrec_are_dead_space(saved):
    store, directory, turns, original = saved
    with store.open(IDENT, "d", layout_of(original)) as sess:
        sess.load(make_cache("mla"))
        sess.truncate(3)
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 3)
    assert res.warnings == []


def test_malformed_turn_entry_keeps_the_turns_before(saved):
    store, directory, turns, original = saved
    doc = json.loads((directory / "d.json").read_text())
    doc["turns"][3]["first"] += 1
    (directory / "d.json").write_text(json.dumps(doc))
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 3)
    assert any("turn 4 is malformed" in w for w in res.warnings)


@pytest.mark.parametrize("content", [b"", b"{", b"\xff\xfe", b"[]", b'{"format": 1}', b"null"])
def test_damaged_sidecar_is_refused(saved, content):
    store, directory, _, _ = saved
    (directory / "d.json").write_bytes(content)
    with pytest.raises(SessionError, match="damaged.*move .* aside"):
        load(store)


def test_sidecar_from_a_newer_colichat_is_refused(saved):
    store, directory, _, _ = saved
    doc = json.loads((directory / "d.json").read_text())
    (directory / "d.json").write_text(json.dumps(dict(doc, format=99)))
    with pytest.raises(SessionError, match="newer colichat"):
        load(store)


def test_other_weights_of_the_same_shapes_are_refused(saved):
    store, directory, _, _ = saved
    other = store.model_dir(OTHER_IDENT)
    other.mkdir()
    for ext in (".coli_kv", ".json"):
        (other / ("d" + ext)).write_bytes((directory / ("d" + ext)).read_bytes())
    with pytest.raises(SessionError, match="other weights"):
        load(store, ident=OTHER_IDENT)


def test_saved_length_beyond_the_context_limit_is_refused(saved):
    store, _, turns, original = saved
    n = turns[-1].last
    with pytest.raises(SessionError, match="context limit"):
        load(store, ctx_limit=n)
    with pytest.raises(SessionError, match="context limit"):
        load(store, ctx_limit=n + 10, margin=10)
    res, cache = load(store, ctx_limit=n + 10, margin=9)
    check_prefix(res, cache, turns, original, N_TURNS)


def test_bare_file_with_foreign_tokens_keeps_the_part_before(saved):
    store, directory, turns, original = saved
    os.unlink(directory / "d.json")
    patch_file(directory / "d.coli_kv", 40 + 17 * RB, struct.pack("<i", 10**6))
    res, cache = load(store, detokenize=lambda ids: f"{len(ids)} ids")
    assert res.tokens == 17 and [(t.role, t.text, t.first, t.last) for t in res.turns] == \
        [("imported", "17 ids", 0, 17)]
    assert cache.raw(0, 17).tobytes() == original.raw(0, 17).tobytes()
    assert any("outside the vocabulary" in w for w in res.warnings)


@pytest.mark.parametrize("which", [".coli_kv", ".json"])
def test_symlinked_session_file_is_refused(saved, tmp_path, which):
    store, directory, _, _ = saved
    target = tmp_path / ("elsewhere" + which)
    os.replace(directory / ("d" + which), target)
    os.symlink(target, directory / ("d" + which))
    with pytest.raises(SessionError, match="symbolic link"):
        load(store)


@pytest.mark.parametrize("which", [".coli_kv", ".json"])
def test_file_the_os_refuses_to_open(saved, monkeypatch, which):
    store, directory, _, _ = saved
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if str(path).endswith("d" + which):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.raises(SessionError, match="permission denied"):
        load(store)


def test_chmod_000_session(saved):
    """As root the OS still lets us read; either way: refused or loaded, nothing modified."""
    store, directory, turns, original = saved
    os.chmod(directory / "d.coli_kv", 0)
    try:
        res, cache = load(store)
        assert os.geteuid() == 0
        check_prefix(res, cache, turns, original, N_TURNS)
    except SessionError as e:
        assert "permission denied" in str(e)
    assert os.stat(directory / "d.coli_kv").st_mode & 0o777 == 0


def test_repair_happens_on_the_next_save_only(saved):
    store, directory, turns, original = saved
    offset = 40 + turns[3].first * RB + 9
    patch_file(directory / "d.coli_kv", offset, b"\xff")
    res, cache = load(store)  # read-only: the damage is still on disk
    check_prefix(res, cache, turns, original, 3)
    cache2 = make_cache("mla")
    with store.open(IDENT, "d", layout_of(cache2)) as sess:
        res = sess.load(cache2)
        again = build(cache2, N_TURNS)  # the conversation goes on: turns 4-5 computed again
        sess.append(cache2, again)
    res, cache = load(store)
    assert res.warnings == []
    check_prefix(res, cache, turns, original, N_TURNS)


def test_random_damage_never_crashes(saved):
    """Random byte edits anywhere in the KV file: a refusal or a prefix of the real turns."""
    store, directory, turns, original = saved
    good = (directory / "d.coli_kv").read_bytes()
    rng = np.random.default_rng(5)
    for _ in range(150):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, len(data)))
            data[pos] = int(rng.integers(0, 256))
        if rng.random() < 0.3:
            data = data[: int(rng.integers(0, len(data)))]
        (directory / "d.coli_kv").write_bytes(bytes(data))
        try:
            res, cache = load(store)
        except SessionError:
            continue
        k = len(res.turns)
        assert res.turns == plan(N_TURNS)[:k] == turns[:k]
        n = res.tokens
        assert cache.raw(0, n).tobytes() == original.raw(0, n).tobytes()


def test_random_sidecar_damage_never_crashes(saved):
    store, directory, turns, _ = saved
    good = (directory / "d.json").read_bytes()
    rng = np.random.default_rng(6)
    for _ in range(150):
        data = bytearray(good)
        pos = int(rng.integers(0, len(data)))
        data[pos] = int(rng.integers(0, 256))
        (directory / "d.json").write_bytes(bytes(data))
        try:
            res, _ = load(store)
        except SessionError:
            continue
        assert [(t.first, t.last) for t in res.turns] == [(t.first, t.last) for t in turns[: len(res.turns)]]


def test_saved_token_outside_the_vocabulary_drops_its_turn(colichat_home):
    cache = make_cache("mla")
    turns = build(cache, 3)
    cache.tokens[turns[1].first + 1] = 10**6  # a writer bug: the CRC matches, the id cannot be right
    store = Store()
    with store.create(IDENT, layout_of(cache), name="d") as sess:
        sess.append(cache, turns)
    res, loaded = load(store)
    check_prefix(res, loaded, turns, cache, 1)
    assert any("turns 2-3" in w and "outside the vocabulary" in w for w in res.warnings)


def test_bare_file_with_huge_nrec(saved):
    store, directory, turns, original = saved
    os.unlink(directory / "d.json")
    patch_file(directory / "d.coli_kv", kvfile.NREC_OFFSET, struct.pack("<i", 2**31 - 1))
    res, cache = load(store)
    n = turns[-1].last
    assert res.tokens == n and len(res.turns) == 1 and res.turns[0].role == "imported"
    assert cache.raw(0, n).tobytes() == original.raw(0, n).tobytes()
