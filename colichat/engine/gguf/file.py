"""A well-formed GGUF file read in one pass: what open_gguf's callers use of gguf-py's GGUFReader.

gguf-py's reader makes numpy views for every string of the vocabulary and merge arrays: on a
first start that is seconds of blank screen for a 49k-token vocabulary (3-8 s for SmolLM2 on a
busy 2-core machine). The header is walked once by header.read_header (tens of ms); this maps
each tensor's data the way gguf-py does (F16/F32/F64/I8-I64 as their numpy type, quantized types
as bytes of shape `quant_shape_to_byte_shape`). It only accepts what it fully understands: a
little-endian v2/v3 file, strict UTF-8, no duplicate keys or tensors, no arrays of arrays, a u32
power-of-two general.alignment, known tensor types whose shapes fill whole blocks; anything else
raises HeaderError and open_gguf reads the file with gguf-py instead (whose messages name what is
wrong). A file that ends before its header or a tensor's data does raises Truncated, saying where:
gguf-py would only fail inside numpy on it.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import NamedTuple

import numpy as np

from .header import DEFAULT_ALIGNMENT, HeaderError, read_header


class Truncated(Exception):
    """The file ends before its header or a tensor's data does; the message says where (one line)."""


class Field:
    """One metadata value; `contents()` as gguf-py's ReaderField returns it."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class TensorInfo(NamedTuple):
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple         # ggml order (ne)
    n_bytes: int
    data_offset: int     # in the file
    data: np.ndarray     # memory-mapped, numpy layout (gguf-py's ReaderTensor.data)


class GGUFFile:
    """`fields` (key -> Field), `tensors` (TensorInfo, in file order), `path`."""

    def __init__(self, path: str):
        import gguf

        self.path = path
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = buf
        try:
            head = read_header(buf, keep=lambda key: True, strict=True)
        except struct.error:  # the walk needed bytes past the end
            raise Truncated(f"the file ends at byte {len(buf):,}, inside its header") from None
        (n_kv,) = struct.unpack_from("<Q", buf, 16)
        if len(head.kv) != n_kv:  # a key twice, or an array of arrays (walked, not kept)
            raise HeaderError("duplicate key or array of arrays")
        align = head.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align != head.alignment or align & (align - 1):
            raise HeaderError("bad general.alignment")
        self.fields: dict[str, Field] = {key: Field(value) for key, value in head.kv.items()}
        self.tensors: list[TensorInfo] = []
        names = set()
        types = {t.value: t for t in gguf.GGMLQuantizationType}
        for name, dims, qtype, rel in head.tensors:
            if name in names:
                raise HeaderError(f"duplicate tensor {name}")
            names.add(name)
            kind = types.get(qtype)
            if kind not in gguf.GGML_QUANT_SIZES:
                raise HeaderError(f"tensor {name} has unknown type {qtype}")
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            if dims and dims[0] % block:
                raise HeaderError(f"tensor {name}'s rows do not fill whole blocks of its type")
            n_bytes = n_elems * type_size // block
            np_dims = tuple(reversed(dims))
            dtype = PLAIN.get(kind.name)
            if dtype is None:
                dtype, count = np.uint8, n_bytes
                np_dims = gguf.quant_shape_to_byte_shape(np_dims, kind)
            else:
                count = n_elems
            at = head.data_start + rel
            if at + n_bytes > len(buf):
                raise Truncated(f"the file ends at byte {len(buf):,}, but tensor {name}'s data runs to byte "
                                f"{at + n_bytes:,}")
            data = np.frombuffer(buf, dtype, count, at).reshape(np_dims)
            self.tensors.append(TensorInfo(name, kind, tuple(dims), n_bytes, at, data))


PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}


MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages now, read from the file where not in memory
PAGE = mmap.PAGESIZE


def madvise():
    """libc's madvise as a ctypes function (calls release the GIL), or None where there is none."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


def populate(data: np.ndarray, advise) -> bool:
    """Map the pages of `data` (a view of a file's memory map) into this process now, as one call of
    `advise` (madvise()) with MADV_POPULATE_READ: what the first product over them would otherwise fault in
    a page at a time, much faster in one call. False where it is refused (not Linux 5.14+, not a map):
    nothing is changed then."""
    if data.nbytes == 0:
        return True
    start = data.ctypes.data // PAGE * PAGE
    return advise(start, data.ctypes.data + data.nbytes - start, MADV_POPULATE_READ) == 0
