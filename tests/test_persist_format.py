"""The .coli_kv layout is exactly the issue's COLIKV1 text: checked against a parser (persist_helpers.parse_colikv1)
and a writer written from that text with struct, independent of colichat's record dtype. Also the sidecar."""

from __future__ import annotations

import json
import struct
import zlib
from datetime import datetime

import numpy as np
import pytest
from persist_helpers import IDENT, VOCAB, build, layout_of, make_cache, parse_colikv1, plan

from colichat.engine.cache import KVCache
from colichat.persist import CacheLayout, SessionError, Store, Turn
from colichat.persist.kvfile import HEADER_SIZE

MAGICS = {"mla": b"COLIKV1\0", "gqa": b"COLIGQA\0"}


def parse(data: bytes) -> tuple[tuple, list]:
    """Header ints and [(token, [(a floats, b floats) per layer])]: parse_colikv1's, without index keys."""
    header, records, _ = parse_colikv1(data)
    return header, [(token, layers) for token, layers, _ in records]


def write_colikv1(path, n_layers, kv_lora, rope, vocab, records, index_hd=0, n_idx=0, magic=b"COLIKV1\0"):
    """Independent writer: records = [(token, [(c floats, k_pe floats) per layer])]."""
    out = [magic, struct.pack("<8i", n_layers, kv_lora, rope, index_hd, n_idx, vocab, len(records), 0)]
    for token, layers in records:
        out.append(struct.pack("<i", token))
        for c, k_pe in layers:
            out.append(struct.pack(f"<{kv_lora}f", *c) + struct.pack(f"<{rope}f", *k_pe))
    path.write_bytes(b"".join(out))


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_written_file_matches_independent_parser(colichat_home, kind):
    cache = make_cache(kind)
    turns = build(cache, 5)
    with Store().create(IDENT, layout_of(cache), name="fmt") as sess:
        sess.append(cache, turns[:2])
        sess.append(cache, turns)
        kv_path = sess.kv_path
    data = open(kv_path, "rb").read()
    header, records = parse(data)
    n = turns[-1].last
    assert header == (MAGICS[kind], cache.n_layer, cache.a_width, cache.b_width, 0, 0, VOCAB, n, 0)
    assert len(data) == 40 + n * (4 + 4 * cache.n_layer * (cache.a_width + cache.b_width))
    for r, (token, layers) in enumerate(records):
        assert token == cache.tokens[r]
        for layer, (a, b) in enumerate(layers):
            assert a == tuple(cache.a[layer][r].tolist())  # the engine's own views of c / K
            assert b == tuple(cache.b[layer][r].tolist())  # and of k_pe / V


def test_reads_a_file_from_an_independent_writer(colichat_home):
    rng = np.random.default_rng(7)
    n_layers, kv_lora, rope = 3, 16, 4

    def layer():
        return rng.standard_normal(kv_lora).tolist(), rng.standard_normal(rope).tolist()

    recs = [(int(rng.integers(VOCAB)), [layer() for _ in range(n_layers)]) for _ in range(9)]
    store = Store()
    directory = store.model_dir(IDENT)
    directory.mkdir(parents=True)
    write_colikv1(directory / "other.coli_kv", n_layers, kv_lora, rope, VOCAB, recs)

    cache = make_cache("mla")
    seen = []
    with store.open(IDENT, "other", layout_of(cache)) as sess:
        res = sess.load(cache, detokenize=lambda ids: seen.append(ids) or "imported text")
        assert res.tokens == 9 and res.turns == [Turn("imported", "imported text", 0, 9)]
        assert any("imported turn" in w for w in res.warnings)
        assert seen == [[t for t, _ in recs]]
        for r, (token, layers) in enumerate(recs):
            assert cache.tokens[r] == token
            for layer, (c, k_pe) in enumerate(layers):
                assert np.array_equal(cache.a[layer][r], np.float32(c))
                assert np.array_equal(cache.b[layer][r], np.float32(k_pe))
        # Continuing the imported conversation keeps the file a plain COLIKV1 file.
        cache.records["token"][9:12] = [1, 2, 3]
        cache.set_length(12)
        sess.append(cache, res.turns + [Turn("user", "more", 9, 12)])
    header, parsed = parse((directory / "other.coli_kv").read_bytes())
    assert header[7] == 12 and parsed[:9] == [(t, [(tuple(np.float32(c)), tuple(np.float32(k)))
                                                  for c, k in ls]) for t, ls in recs]
    with store.open(IDENT, "other", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    assert [t.role for t in res.turns] == ["imported", "user"] and res.warnings == []


@pytest.mark.parametrize("field,value,word", [
    ("n_layers", 4, "n_layers"), ("kv_lora", 15, "kv_lora"), ("qk_rope", 8, "qk_rope"),
    ("index_hd", 64, "index_hd"), ("n_idx", 2, "indexed layers"), ("vocab", VOCAB + 1, "vocab"),
])
def test_header_of_another_model_is_refused(colichat_home, field, value, word):
    args = dict(n_layers=3, kv_lora=16, rope=4, vocab=VOCAB, index_hd=0, n_idx=0)
    args[{"n_layers": "n_layers", "kv_lora": "kv_lora", "qk_rope": "rope"}.get(field, field)] = value
    store = Store()
    directory = store.model_dir(IDENT)
    directory.mkdir(parents=True)
    write_colikv1(directory / "x.coli_kv", records=[], **args)
    cache = make_cache("mla")
    with store.open(IDENT, "x", layout_of(cache)) as sess, pytest.raises(SessionError, match=word) as e:
        sess.load(cache)
    assert "another model" in str(e.value) and "\n" not in str(e.value)


def test_mla_session_is_refused_by_a_gqa_model(colichat_home):
    cache = make_cache("mla")
    with Store().create(IDENT, layout_of(cache), name="k") as sess:
        sess.append(cache, build(cache, 1))
    gqa = CacheLayout("gqa", 3, 16, 4, VOCAB)
    with Store().open(IDENT, "k", gqa) as sess, pytest.raises(SessionError, match="another kind"):
        sess.load(KVCache("gqa", 3, 16, 4, 64))


def test_sidecar_contents(colichat_home):
    cache = make_cache("mla")
    turns = build(cache, 3)
    with Store().create(IDENT, layout_of(cache), name="side", sampler={"temperature": 0.7}) as sess:
        sess.append(cache, turns)
        json_path = sess.json_path
    doc = json.loads(open(json_path, encoding="utf-8").read())
    assert doc["format"] == 2 and doc["model"] == IDENT
    assert doc["sampler"] == {"temperature": 0.7}
    assert datetime.fromisoformat(doc["created"]) <= datetime.fromisoformat(doc["updated"])
    assert [(t["role"], t["text"], t["first"], t["last"]) for t in doc["turns"]] == \
        [(t.role, t.text, t.first, t.last) for t in turns]
    assert [t["crc32"] for t in doc["turns"]] == [zlib.crc32(cache.raw(t.first, t.last)) for t in turns]
    # The checks, computed here from FORMAT.md's description alone.
    def canonical_crc(value):
        return zlib.crc32(json.dumps(value, ensure_ascii=True, sort_keys=True, separators=(",", ":")).encode())

    assert [t["check"] for t in doc["turns"]] == \
        [canonical_crc([t["role"], t["text"], t["first"], t["last"], t["crc32"]]) for t in doc["turns"]]
    assert doc["check"] == canonical_crc({k: v for k, v in doc.items() if k not in ("turns", "check")})


def test_a_format_1_sidecar_still_loads_with_a_warning(colichat_home):
    """Sidecars of an older colichat have no checks: they load, saying so, and the next save adds them."""
    cache = make_cache("mla")
    turns = build(cache, 3)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="old") as sess:
        sess.append(cache, turns)
        json_path = sess.json_path
    doc = json.loads(open(json_path, encoding="utf-8").read())
    doc["format"] = 1
    del doc["check"]
    for t in doc["turns"]:
        del t["check"]
    open(json_path, "w", encoding="utf-8").write(json.dumps(doc))
    with store.open(IDENT, "old", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
        assert res.turns == turns and res.warnings == [
            "the sidecar was written by an older colichat: its turn texts carry no checksum (the next save adds them)"]
        sess.truncate(3)
    with store.open(IDENT, "old", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    assert res.turns == turns and res.warnings == []


def test_truncate_cuts_the_file_and_append_writes_after_the_kept_records(colichat_home):
    cache = make_cache("mla")
    turns = build(cache, 4)
    store = Store()
    with store.create(IDENT, layout_of(cache), name="t") as sess:
        sess.append(cache, turns)
        sess.truncate(2)
        assert sess.nrec == turns[1].last and sess.turns == turns[:2]
        record = sess.layout.record_bytes
        assert open(sess.kv_path, "rb").seek(0, 2) == HEADER_SIZE + turns[1].last * record  # cut to its records
        assert parse(open(sess.kv_path, "rb").read())[0][7] == turns[1].last
        other = make_cache("mla")  # a different third turn, in the same rows
        other.records[: turns[1].last] = cache.records[: turns[1].last]
        other.records["token"][turns[1].last : turns[1].last + 3] = [5, 6, 7]
        other.set_length(turns[1].last + 3)
        new = Turn("assistant", "regenerated", turns[1].last, turns[1].last + 3)
        sess.append(other, sess.turns + [new])
        assert open(sess.kv_path, "rb").seek(0, 2) == HEADER_SIZE + new.last * record
    with store.open(IDENT, "t", layout_of(cache)) as sess:
        res = sess.load(loaded := make_cache("mla"))
    assert res.turns == turns[:2] + [new] and res.warnings == []
    assert np.array_equal(loaded.records[: new.last], other.records[: new.last])


def test_summary_line(colichat_home):
    cache = make_cache("mla")
    with Store().create(IDENT, layout_of(cache), name="s") as sess:
        sess.append(cache, build(cache, 3))
    with Store().open(IDENT, "s", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    line = res.summary()
    assert line.startswith(f"resumed {plan(3)[-1].last} tokens, 3 turns from s in ")
    assert line.endswith(" ms, no re-prefill")


def test_turns_may_be_any_objects_with_the_four_fields(colichat_home):
    from dataclasses import dataclass

    @dataclass
    class ChatTurn:  # e.g. the chat program's own, mutable turn record
        role: str
        text: str
        first: int
        last: int

    cache = make_cache("mla")
    turns = [ChatTurn(t.role, t.text, t.first, t.last) for t in build(cache, 4)]
    with Store().create(IDENT, layout_of(cache), name="duck") as sess:
        sess.append(cache, turns[:2])
        sess.append(cache, turns)  # the whole list again: its saved head is recognised
        sess.truncate(10)  # more than saved: keeps all
        assert sess.nrec == turns[-1].last and len(sess.turns) == 4
        turns[3].text = "edited later"  # the session holds its own copies
    with Store().open(IDENT, "duck", layout_of(cache)) as sess:
        res = sess.load(make_cache("mla"))
    assert [t.text for t in res.turns] == [t.text for t in plan(4)]
