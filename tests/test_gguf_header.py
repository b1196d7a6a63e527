"""gguf/header.py reads the same metadata and tensor infos as gguf-py, and says when a buffer is short."""

from __future__ import annotations

import struct

import gguf
import pytest
from conftest import TINY, VOCAB

from colichat.engine.gguf.header import HeaderError, read_header


@pytest.mark.parametrize("path", [TINY / "ds-v3.q8_0.gguf", TINY / "minicpm3.gguf", VOCAB / "ggml-vocab-phi-3.gguf"],
                         ids=lambda p: p.name)
def test_same_as_gguf_py(path):
    data = path.read_bytes()
    head = read_header(data, keep=lambda key: True)
    reader = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert head.kv.keys() == want.keys()
    for k, v in want.items():
        assert head.kv[k] == pytest.approx(v) if isinstance(v, float) else head.kv[k] == v, k
    assert head.data_start == reader.data_offset
    got = [(t.name, tuple(t.shape), t.ggml_type, head.data_start + t.offset) for t in head.tensors]
    assert got == [(t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset))
                   for t in reader.tensors]


def test_short_buffer_and_not_gguf():
    data = (TINY / "plm.gguf").read_bytes()
    head = read_header(data)
    for n in (10, 100, head.data_start // 2, head.data_start - 40):
        with pytest.raises(struct.error):
            read_header(data[:n])
    assert read_header(data[: head.data_start]).tensors == head.tensors
    with pytest.raises(HeaderError):
        read_header(b"GGUF\x01\x00\x00\x00" + data[8:])  # version 1
    with pytest.raises(HeaderError):
        read_header(b"GGML" + data[4:])
