"""Sessions of sparse-attention MLA models: the COLIKV1 header and records carry the indexer keys
(Ic) exactly as docs/dsa-mtp-spec.md says (checked with the tests' own parser, persist_helpers.parse_colikv1), a file
of another indexer shape is refused with one line, /rewind, /new and /resume work, and MTP rows
are never written. (Resume in a new process: test_persist_resume.py.)
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from conftest import TINY
from persist_helpers import parse_colikv1

from colichat.conversation.chat import Conversation, Settings
from colichat.engine import load
from colichat.engine.mtp import MTPBlock
from colichat.persist import CacheLayout, SessionError, Store, Turn, model_identity


@pytest.fixture(scope="module")
def glm():
    return load(str(TINY / "glm-dsa.gguf"), n_ctx=256)


def ident_layout(model):
    cfg = model.cfg
    return model_identity(cfg.path, cfg.arch, cfg.name), CacheLayout.from_cache(model.cache, cfg.n_vocab)


def test_header_and_records_carry_ic_as_the_spec_says(glm, colichat_home):
    """glm-dsa: 4 layers, kv_lora 128, qk_rope 16, indexer types [1, 0, 1, 0] with Di 64:
    h[3] = 64, h[4] = 2, record = 4 + 4 x (4 x 144 + 2 x 64) = 2820 bytes; Ic of layers 0 and 2."""
    glm.reset()
    ids = np.load(TINY / "glm-dsa.ref.npz")["tokens_0"][:30]
    glm.prefill(ids)
    ident, layout = ident_layout(glm)
    assert (layout.index_hd, layout.n_index_layers, layout.record_bytes) == (64, 2, 2820)
    with Store().create(ident, layout, name="dsa") as sess:
        sess.append(glm.cache, [Turn("user", "x", 0, 30)])
        kv_path = sess.kv_path
    data = open(kv_path, "rb").read()
    header, records, end = parse_colikv1(data)
    assert header == (b"COLIKV1\0", 4, 128, 16, 64, 2, 268, 30, 0)
    assert end == len(data) == 40 + 30 * 2820 == 84640
    # FORMAT.md's offsets: record 0's Ic of layer 2 is its bytes 2564..2820
    assert data[40 + 2564 : 40 + 2820] == glm.cache.ic[1][0].tobytes()
    for r, (token, layers, ic) in enumerate(records):
        assert token == ids[r]
        for l, (c, k_pe) in enumerate(layers):
            assert c == tuple(glm.cache.a[l][r].tolist()) and k_pe == tuple(glm.cache.b[l][r].tolist())
        assert ic == [tuple(glm.cache.ic[j][r].tolist()) for j in range(2)]
    # the two Ic slots hold two layers' keys (layers 0 and 2), not one copied
    assert not np.array_equal(glm.cache.ic[0][:30], glm.cache.ic[1][:30])


def test_a_file_of_another_indexer_shape_is_refused_with_one_line(glm, colichat_home):
    glm.reset()
    ident, layout = ident_layout(glm)
    store = Store()
    directory = store.model_dir(ident)
    directory.mkdir(parents=True)
    for name, hd, nic in (("plain", 0, 0), ("wide", 128, 2), ("more", 64, 4)):
        (directory / f"{name}.coli_kv").write_bytes(
            b"COLIKV1\0" + struct.pack("<8i", 4, 128, 16, hd, nic, 268, 0, 0))
        with store.open(ident, name, layout) as sess, pytest.raises(SessionError) as e:
            sess.load(glm.cache)
        msg = str(e.value)
        assert "another model" in msg and "\n" not in msg
        assert ("index_hd" in msg) == (hd != 64) and ("indexed layers" in msg) == (nic != 2)
    assert glm.cache.length == 0


def test_rewind_new_and_resume(glm, colichat_home):
    glm.reset()
    conv = Conversation(glm, Settings(temperature=0, max_tokens=8), session_name="talk")
    conv.ask("hello there")
    after1 = glm.cache.records[: glm.cache.length].copy()
    conv.ask("and a second question, longer than top_k")
    after2 = glm.cache.records[: glm.cache.length].copy()
    assert after2.size > 2 * glm.cfg.index_top_k
    conv.rewind(1)
    assert glm.cache.length == after1.size
    conv.ask("and a second question, longer than top_k")
    assert glm.cache.records[: glm.cache.length].tobytes() == after2.tobytes()  # same rows, Ic included
    assert "talk" in conv.new() and glm.cache.length == 0
    conv.resume("talk")
    assert glm.cache.records[: glm.cache.length].tobytes() == after2.tobytes()
    conv.rewind(1)  # on disk too: a fresh resume sees the first exchange only
    conv.close()
    again = Conversation(glm, Settings(temperature=0))
    glm.reset()
    again.resume("talk")
    assert glm.cache.records[: glm.cache.length].tobytes() == after1.tobytes()
    again.close()


def test_mtp_rows_are_never_written(glm, colichat_home):
    """The file's layers are the trunk's (h[1] = 4, not 5) and its records hold no MTP row; after
    a load the MTP block's cache is empty."""
    glm.reset()
    ids = np.load(TINY / "glm-dsa.ref.npz")["tokens_0"]
    _, h = glm.prefill(ids, hidden=True)
    mtp = MTPBlock(glm)
    mtp.forward(np.concatenate([np.zeros((1, 256), np.float32), h[:-1]]), ids)
    ident, layout = ident_layout(glm)
    with Store().create(ident, layout, name="m") as sess:
        sess.append(glm.cache, [Turn("user", "x", 0, ids.size)])
        kv_path = sess.kv_path
    data = open(kv_path, "rb").read()
    header, records, end = parse_colikv1(data)
    assert header[1] == 4 and end == len(data) == 40 + ids.size * 2820
    mtp_rows = mtp.cache.records["kv"][: ids.size, 0].tobytes()
    assert mtp_rows not in data
    glm.reset()
    fresh = MTPBlock(glm)
    with Store().open(ident, "m", layout) as sess:
        sess.load(glm.cache)
    assert glm.cache.length == ids.size and fresh.cache.length == 0
