"""The one-pass GGUF reader (engine/gguf_file.py) gives what gguf-py's GGUFReader gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import TINY

from colichat.engine.gguf import ModelError, open_gguf
from colichat.engine.gguf_file import GGUFFile
from colichat.engine.gguf_header import HeaderError, read_header


@pytest.mark.parametrize("path", sorted(TINY.glob("*.gguf")), ids=lambda p: p.name)
def test_same_fields_and_tensors_as_gguf_py(path):
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path), "r")
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for k in keys:
        a, b = ours.fields[k].contents(), ref.fields[k].contents()
        assert a == b and type(a) is type(b), k
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_open_gguf_uses_it_and_falls_back_to_gguf_py(tmp_path):
    assert isinstance(open_gguf(str(TINY / "llama.gguf")), GGUFFile)
    # a file it does not accept (a duplicated key) is read by gguf-py, whose message names the problem
    src = (TINY / "llama.gguf").read_bytes()
    n_kv = int.from_bytes(src[16:24], "little")
    first_kv_end = 24 + 8 + int.from_bytes(src[24:32], "little") + 4  # key, type
    assert int.from_bytes(src[first_kv_end - 4:first_kv_end], "little") == 8  # general.architecture: a string
    first_kv_end += 8 + int.from_bytes(src[first_kv_end:first_kv_end + 8], "little")
    dup = src[:16] + (n_kv + 1).to_bytes(8, "little") + src[24:first_kv_end] + src[24:]
    bad = tmp_path / "dup.gguf"
    bad.write_bytes(dup)
    with pytest.raises(HeaderError, match="duplicate key"):
        GGUFFile(str(bad))
    with pytest.raises(ModelError, match="damaged or truncated GGUF file"):
        open_gguf(str(bad))


def test_bad_utf8_refused_here_replaced_by_the_lenient_walk(tmp_path):
    src = bytearray((TINY / "llama.gguf").read_bytes())
    value = 24 + 8 + int.from_bytes(src[24:32], "little") + 4 + 8  # first value: general.architecture
    assert src[value:value + 5] == b"llama"
    src[value] = 0xFF
    bad = tmp_path / "utf8.gguf"
    bad.write_bytes(bytes(src))
    with pytest.raises(HeaderError, match="not UTF-8"):
        GGUFFile(str(bad))
    assert read_header(bytes(src), keep=lambda key: True).kv["general.architecture"] == "\ufffdlama"
