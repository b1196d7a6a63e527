"""The header of a GGUF file, walked directly: metadata keys and tensor infos, without gguf-py.

    head = read_header(buf, keep=lambda key: key.startswith("tokenizer."))
    head.kv            # {key: value} for the kept keys (arrays as lists, strings as str)
    head.tensors       # [TensorInfo(name, shape (ggml order), ggml_type, offset)], offsets in the data region
    head.data_start    # where the data region begins (aligned to head.alignment)

gguf-py's reader builds numpy views for every string of the token and merge arrays and for every
tensor, which takes seconds for large vocabularies. This is the one walker of the project's GGUF
headers: the tokenizer reads a few keys of a path, the session store the tensor offsets of a
model's weights fingerprint, and file.py a whole model's keys and tensors (strict=True). Layout
(little-endian GGUF v2/v3): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv times
(string key, u32 value type, value); n_tensors times (string name, u32 n_dims, u64 dims[n_dims],
u32 type, u64 offset); padding to the alignment; the data. A string is a u64 length and UTF-8
bytes; an array a u32 element type, a u64 count and the elements.

`buf` may be shorter than the file (the store reads the first MiB, then more): struct.error means
it ends inside the header (the padding before the data region is not checked); HeaderError means
it is not a GGUF this reader walks (its callers then refuse the file, or let gguf-py read it). Strings
with bad UTF-8 are decoded with replacement characters, or with strict=True refused (HeaderError).
"""

from __future__ import annotations

import struct
from typing import Callable, NamedTuple

import numpy as np

STRING, ARRAY = 8, 9
# value type -> struct/numpy code of the scalar types (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRUCTS = {t: struct.Struct("<" + c) for t, c in SCALARS.items()}
_DTYPES = {t: np.dtype("<" + c) for t, c in SCALARS.items()}
_U64 = struct.Struct("<Q").unpack_from
_U32 = struct.Struct("<I").unpack_from
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 24  # more keys or tensors than this: not a file we walk


class HeaderError(Exception):
    """Not a GGUF header this walker reads: damaged, or of a kind it does not walk."""


class TensorInfo(NamedTuple):
    name: str
    shape: tuple  # ggml order (ne)
    ggml_type: int
    offset: int   # within the data region


class Header(NamedTuple):
    version: int
    kv: dict
    tensors: list
    data_start: int
    alignment: int  # of the data region: a u32 general.alignment when not 0, else 32


def _string(buf, pos: int) -> tuple[int, int]:
    """(start, end) of the string at pos; struct.error when buf ends before it does."""
    (n,) = _U64(buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise struct.error("buffer ends inside a string")
    return pos + 8, end


def _value(buf, pos: int, vtype: int, keep: bool, errors: str):
    """(value or None when not kept, position after it); strings decoded with `errors`."""
    scalar = _STRUCTS.get(vtype)
    if scalar is not None:
        return (scalar.unpack_from(buf, pos)[0] if keep else None), pos + scalar.size
    if vtype == STRING:
        a, b = _string(buf, pos)
        return (buf[a:b].decode("utf-8", errors) if keep else None), b
    if vtype == ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        dtype = _DTYPES.get(etype)
        if dtype is not None:
            end = pos + dtype.itemsize * count
            if end > len(buf):
                raise struct.error("buffer ends inside an array")
            return (np.frombuffer(buf, dtype, count, pos).tolist() if keep else None), end
        if etype == STRING:  # the token and merge lists: the hot loop of a tokenizer's start
            values, u64, n_buf = [], _U64, len(buf)
            try:
                for _ in range(count):
                    (n,) = u64(buf, pos)
                    if keep:
                        values.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors))
                    pos += 8 + n
            except OverflowError:  # a damaged length that no slice can take
                raise struct.error("a string longer than the file") from None
            if pos > n_buf:
                raise struct.error("buffer ends inside an array")
            return (values if keep else None), pos
        if etype == ARRAY:  # arrays of arrays: walked, never kept
            for _ in range(count):
                _, pos = _value(buf, pos, ARRAY, False, errors)
            return None, pos
        raise HeaderError(f"unknown GGUF array element type {etype}")
    raise HeaderError(f"unknown GGUF value type {vtype}")


def read_header(buf, keep: Callable[[str], bool] = lambda key: False, tensors: bool = True,
                strict: bool = False) -> Header:
    """Walk the header at the start of `buf` (bytes or an mmap), keeping the keys `keep` accepts
    (general.alignment is always read). With tensors=False it stops after the metadata; with
    strict=True a string that is not valid UTF-8 raises instead of being decoded with U+FFFD."""
    if len(buf) < 24:
        raise struct.error("buffer shorter than the GGUF preamble")
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise HeaderError("not a little-endian GGUF v2/v3 file")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise HeaderError("implausible key or tensor count")
    try:
        return _walk(buf, version, n_tensors, n_kv, keep, tensors, "strict" if strict else "replace")
    except UnicodeDecodeError as e:  # strict: a key, name or string value that is not UTF-8
        raise HeaderError(f"a string that is not UTF-8 ({e.reason})") from None


def _walk(buf, version: int, n_tensors: int, n_kv: int, keep, tensors: bool, errors: str) -> Header:
    pos, kv, alignment = 24, {}, DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        a, pos = _string(buf, pos)
        key = buf[a:pos].decode("utf-8", errors)
        (vtype,) = _U32(buf, pos)
        is_alignment = key == "general.alignment" and vtype == 4
        kept = keep(key)
        value, pos = _value(buf, pos + 4, vtype, is_alignment or kept, errors)
        if is_alignment:
            alignment = value or DEFAULT_ALIGNMENT
        if kept and value is not None:
            kv[key] = value
    infos = []
    if tensors:
        for _ in range(n_tensors):
            a, pos = _string(buf, pos)
            name = buf[a:pos].decode("utf-8", errors)
            (n_dims,) = _U32(buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append(TensorInfo(name, shape, ggml_type, offset))
    return Header(version, kv, infos, -(-pos // alignment) * alignment, alignment)
