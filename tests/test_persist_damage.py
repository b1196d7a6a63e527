"""Damaged, hostile or foreign session files: a clear one-line refusal or a clean partial load of
whole turns, never a crash, and never a modified file (bytes and mtime compared before/after)."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
from persist_helpers import IDENT, OTHER_IDENT, build, layout_of, make_cache, snapshot

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


GARBAGE = [
    (b"", "empty KV file"),
    (b"COLIKV1\0\x03\0", "truncated header: 10 bytes, a header needs 40"),
    (b"GGUF" + bytes(100), "not a KV file: magic b'GGUF\\x00\\x00\\x00\\x00'"),
    (bytes(range(256)) * 20, "not a KV file: magic b'\\x00\\x01\\x02\\x03\\x04\\x05\\x06\\x07'"),
    (b"COLIKV1\0" + struct.pack("<8i", 3, 16, 4, 0, 0, 1000, -5, 0), "a negative field in its header: nrec -5"),
]


@pytest.mark.parametrize("content,why", GARBAGE)
def test_a_kv_file_without_a_usable_header_is_read_again_from_its_sidecar(saved, content, why):
    """Its records cannot be read, but the sidecar's text is intact: nothing is refused or lost, every
    exchange is returned to be read again (as for a deleted KV file), and the warning says why."""
    store, directory, turns, _ = saved
    (directory / "d.coli_kv").write_bytes(content)
    [info] = store.list(IDENT)
    assert info.damage is None and info.turns == 4  # (what opening reads again: whole exchanges)
    res, cache = load(store)
    assert res.turns == [] and res.tokens == cache.length == 0 and res.unread == turns[:4]
    assert res.warnings == [f"the KV file d.coli_kv is damaged ({why}): none of the 5 turns listed has its records"]


@pytest.mark.parametrize("content,why", GARBAGE)
def test_a_kv_file_without_a_usable_header_and_no_sidecar_is_refused(saved, content, why):
    store, directory, _, _ = saved
    (directory / "d.coli_kv").write_bytes(content)
    (directory / "d.json").unlink()
    with pytest.raises(SessionError, match=re.escape(f"damaged ({why}); /delete d removes it")):
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


def test_bit_flip_in_header_is_reported_as_damage(saved):
    """The sidecar's fingerprint says this model saved the session: a header that disagrees with it is
    damage (or another session's file put in its place), so the sidecar's text is read again."""
    store, directory, turns, _ = saved
    patch_file(directory / "d.coli_kv", 8, struct.pack("<i", 3 ^ 0x40))
    res, _ = load(store)
    assert res.turns == [] and res.unread == turns[:4]
    assert res.warnings == ["the KV file d.coli_kv is damaged (its header disagrees with the sidecar: n_layer 67 "
                            "(sidecar: 3)): none of the 5 turns listed has its records"]
    patch_file(directory / "d.coli_kv", 0, b"COLIGQA\0")  # a valid magic of the other kind: damage too
    res, _ = load(store)
    assert res.turns == [] and "(its header disagrees with the sidecar: kind gqa (sidecar: mla), n_layer 67" \
        in res.warnings[0]


def test_file_cut_mid_record(saved):
    store, directory, turns, original = saved
    os.truncate(directory / "d.coli_kv", 40 + turns[3].first * RB + RB // 2)
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 3)
    assert any("cut short" in w for w in res.warnings) and any("turns 4-5" in w for w in res.warnings)


def test_a_message_whose_answer_was_cut_off_is_dropped_with_it(saved):
    """The chat's unit is the exchange: a file cut inside turn 4 (an answer) keeps turns 1-2, not 3
    (its message) alone, and says so; without `exchanges` the persist layer keeps every whole turn."""
    store, directory, turns, original = saved
    os.truncate(directory / "d.coli_kv", 40 + turns[3].first * RB + RB // 2)
    res, cache = load(store, exchanges=True)
    check_prefix(res, cache, turns, original, 2)
    assert res.warnings[-1] == (f"dropped turn 3 (records {turns[2].first}-{turns[2].last}): a message whose "
                                "answer is not there (an exchange is kept whole)")
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 3)


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


def test_more_saved_tokens_than_the_context_are_refused_and_a_full_context_loads(saved):
    store, _, turns, original = saved
    n = turns[-1].last
    with pytest.raises(SessionError, match=f"holds {n} tokens, more than the context of {n - 1}: start colichat "
                                           f"with --ctx {n + 16} or more to reopen it with room for an exchange"):
        load(store, ctx_limit=n - 1)
    res, cache = load(store, ctx_limit=n)  # the context full: as it was saved
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


def test_a_changed_byte_in_a_turn_text_drops_that_turn_with_a_warning(saved):
    store, directory, turns, original = saved
    data = (directory / "d.json").read_bytes()
    pos = data.index(b"turn 2: h\xc3\xa9llo") + len("turn 2: h\xc3\xa9l")
    (directory / "d.json").write_bytes(data[:pos] + b"k" + data[pos + 1 :])  # "héllo" -> "hélko"
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 2)
    assert res.warnings == ["sidecar turn 3 is damaged (its role, text or span does not match its checksum): "
                            "dropped it and 2 later"]


def test_a_byte_that_is_not_utf8_in_a_turn_text_drops_that_turn_with_a_warning(saved):
    """Not UTF-8 any more (a bit flipped in a character's first byte): the sidecar is still read, and
    the turn whose text changed goes, as for any other changed byte; the listing shows the session."""
    store, directory, turns, original = saved
    data = (directory / "d.json").read_bytes()
    pos = data.index(b"turn 2: h\xc3\xa9llo") + len("turn 2: h")
    (directory / "d.json").write_bytes(data[:pos] + b"\xe3" + data[pos + 1 :])  # a lead byte without its tail
    res, cache = load(store)
    check_prefix(res, cache, turns, original, 2)
    assert res.warnings == ["sidecar turn 3 is damaged (its role, text or span does not match its checksum): "
                            "dropped it and 2 later"]
    [row] = store.list()
    assert row.name == "d" and not row.damage


def test_changed_settings_in_the_sidecar_are_not_restored(colichat_home):
    cache = make_cache("mla")
    turns = build(cache, 2)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="d", sampler={"temperature": 0.7}) as sess:
        sess.append(cache, turns)
    path = store.model_dir(IDENT) / "d.json"
    path.write_bytes(path.read_bytes().replace(b'"temperature": 0.7', b'"temperature": 0.3'))
    res, loaded = load(store)
    assert res.turns == turns and res.sampler == {}
    assert res.warnings == ["the sidecar's settings do not match their checksum: the saved sampler settings "
                            "were not restored"]


def expected_kv_outcome(good: bytes, data: bytes, changed: set[int], turns) -> int | None:
    """What loading a damaged KV file must give: None (refused) or the number of turns kept, from the
    format alone: the header's fixed fields must match the model, nrec bounds the records, only whole
    records count, and a turn with a changed byte in its records goes with all later ones."""
    if len(data) < 40 or any(p < 32 for p in changed):
        return None
    nrec = struct.unpack_from("<i", data, kvfile.NREC_OFFSET)[0]
    if nrec < 0:
        return None
    avail = min(nrec, (len(data) - 40) // RB)
    bad = {(p - 40) // RB for p in changed if p >= 40}
    kept = 0
    for t in turns:
        if t.last > avail or any(r in bad for r in range(t.first, t.last)):
            break
        kept += 1
    return kept


def test_random_kv_damage_loads_exactly_the_undamaged_turns(saved):
    """Random byte edits (and cuts) anywhere in the KV file: no record kept, every exchange's text to be
    read again, exactly when the header's fixed fields changed; else exactly the turns before the
    first damaged one, with their true records."""
    store, directory, turns, original = saved
    good = (directory / "d.coli_kv").read_bytes()
    rng = np.random.default_rng(5)
    outcomes = {"read again": 0, "partial": 0, "whole": 0, "none kept": 0}
    for _ in range(150):
        data, changed = bytearray(good), set()
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, len(data)))
            new = int(rng.integers(0, 256)) if rng.random() < 0.5 else data[pos] ^ (1 << int(rng.integers(0, 8)))
            if new != good[pos]:
                changed.add(pos)
            data[pos] = new
        if rng.random() < 0.3:
            data = data[: int(rng.integers(0, len(data)))]
            changed = {p for p in changed if p < len(data)}
        (directory / "d.coli_kv").write_bytes(bytes(data))
        expected = expected_kv_outcome(good, bytes(data), changed, turns)
        res, cache = load(store)
        if expected is None:  # no header to use: the sidecar's text is read again
            assert res.turns == [] and res.unread and "is damaged" in res.warnings[0], (sorted(changed), len(data))
            outcomes["read again"] += 1
            continue
        k = len(res.turns)
        assert k == expected, (sorted(changed), len(data), res.warnings)
        assert res.turns == turns[:k]
        assert cache.raw(0, res.tokens).tobytes() == original.raw(0, res.tokens).tobytes()
        assert (k < N_TURNS) <= bool(res.warnings)  # a shortened load always says why
        outcomes["partial" if 0 < k < N_TURNS else "whole" if k == N_TURNS else "none kept"] += 1
    assert outcomes["partial"] >= 30 and outcomes["read again"] >= 1 and outcomes["none kept"] >= 3, outcomes


def turn_of_byte(sidecar: bytes, pos: int) -> int | None:
    """The index of the sidecar turn whose JSON object holds byte `pos` (None: outside the turns)."""
    starts = [sidecar.rfind(b"{", 0, i) for i in range(len(sidecar)) if sidecar.startswith(b'"role"', i)]
    if pos < starts[0]:
        return None
    return max(i for i, st in enumerate(starts) if st <= pos)


def test_random_sidecar_damage_never_loads_wrong_turns(saved):
    """A changed byte anywhere in the sidecar (a flipped bit or a random byte): refused, or the turns
    before the damaged one with their true role, text and records, or (a byte JSON does not see, like
    one blank for another) everything; a load that differs from the saved document always warns."""
    store, directory, turns, original = saved
    good = (directory / "d.json").read_bytes()
    good_doc = json.loads(good)
    rng = np.random.default_rng(6)
    outcomes = {"refused": 0, "partial": 0, "whole": 0}
    for _ in range(300):
        data = bytearray(good)
        pos = int(rng.integers(0, len(data)))
        data[pos] = int(rng.integers(0, 256)) if rng.random() < 0.5 else data[pos] ^ (1 << int(rng.integers(0, 8)))
        if data == good:
            continue
        (directory / "d.json").write_bytes(bytes(data))
        try:
            res, cache = load(store)
        except SessionError:
            outcomes["refused"] += 1
            continue
        k = len(res.turns)
        assert res.turns == turns[:k], (pos, data[pos - 20 : pos + 20])
        assert cache.raw(0, res.tokens).tobytes() == original.raw(0, res.tokens).tobytes()
        try:
            same = json.loads(bytes(data)) == good_doc
        except ValueError:
            same = False
        assert same or res.warnings, (pos, bytes(data[pos - 20 : pos + 20]))  # never silently different
        i = turn_of_byte(good, pos)
        if i is not None and not same:
            assert k == i, (pos, k, i, res.warnings)  # the damaged turn and those after it go
        outcomes["partial" if 0 < k < N_TURNS else "whole" if k == N_TURNS else "refused"] += 1
    assert outcomes["partial"] >= 30 and outcomes["refused"] >= 5, outcomes


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
