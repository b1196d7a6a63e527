"""The one-pass GGUF reader (engine/gguf/file.py) gives what gguf-py's GGUFReader gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import TINY

from colichat.engine.gguf.file import GGUFFile
from colichat.engine.gguf.header import HeaderError, read_header
from colichat.engine.gguf.tensors import open_gguf
from colichat.errors import ModelError


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


def _run_cli(path) -> tuple[int, str]:
    """colichat -p on GGUF `path`, in this process: (exit status, stderr); any exception escapes."""
    import contextlib
    import io

    from colichat.terminal import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["--model", str(path), "-p", "hi", "--max-tokens", "1", "--no-save"])
    return rc, err.getvalue()


@pytest.mark.parametrize("name,flips", [("llama.gguf", 120), ("ds-v3.gguf", 80)])
def test_a_flipped_bit_in_a_gguf_header_is_refused_in_one_line_or_runs(name, flips, tmp_path, colichat_home):
    """A bit flipped anywhere in the header region (metadata, tensor table): colichat runs, or says what
    is wrong in one line (exit 1), never a traceback (before: a string length beyond the file, a text
    value that is not UTF-8 and a shape numpy could not take escaped as exceptions)."""
    good = (TINY / name).read_bytes()
    rng = np.random.default_rng(11)
    bad = tmp_path / name
    for pos in rng.integers(0, 12000, flips):
        data = bytearray(good)
        data[pos] ^= 1 << int(rng.integers(0, 8))
        bad.write_bytes(bytes(data))
        rc, err = _run_cli(bad)
        assert rc == 0 or rc == 1 and err.splitlines()[-1].startswith("colichat: "), (pos, err[-300:])


def test_odd_gguf_values_are_refused_in_one_line(tmp_path, colichat_home):
    from cli_helpers import copy_gguf

    good = (TINY / "llama.gguf").read_bytes()
    cases = {"a string length beyond the file": (763, 0xFF)}
    at = good.index(b"{%")  # the chat template's text
    cases["a chat template that is not UTF-8"] = (at + 1, 0x80)
    for why, (pos, mask) in cases.items():
        data = bytearray(good)
        data[pos] ^= mask
        (tmp_path / "bad.gguf").write_bytes(bytes(data))
        rc, err = _run_cli(tmp_path / "bad.gguf")
        assert rc == 1 and len(err.splitlines()) == 1 and "damaged" in err and "download it again" in err, (why, err)
    path = copy_gguf(TINY / "llama.gguf", tmp_path / "heads.gguf", set_keys={"llama.attention.head_count": 0})
    rc, err = _run_cli(path)
    assert (rc, err) == (1, f"colichat: {path}: damaged GGUF file: llama.attention.head_count 0, "
                            "llama.embedding_length 256; download it again\n")
