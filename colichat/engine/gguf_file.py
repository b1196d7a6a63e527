"""A well-formed GGUF file read in one pass: what open_gguf's callers use of gguf-py's GGUFReader.

gguf-py's reader makes numpy views for every string of the vocabulary and merge arrays: on a
first start that is seconds of blank screen for a 49k-token vocabulary (3-8 s for SmolLM2 on a
busy 2-core machine). This walks the key/value and tensor-info sections once (tens of ms) and
maps each tensor's data the way gguf-py does (F16/F32/F64/I8-I64 as their numpy type, quantized
types as bytes of shape `quant_shape_to_byte_shape`). It only accepts what it fully understands: a
little-endian v2/v3 file, strict UTF-8, no duplicate keys or tensors, every tensor inside the
file; anything else raises ValueError and open_gguf reads the file with gguf-py instead (whose
messages name what is wrong).
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


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
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError("not a little-endian GGUF v2/v3 file")
        off = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key, off = _string(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            value, off = _value(buf, off + 4, vtype)
            if key in self.fields:
                raise ValueError(f"duplicate key {key}")
            self.fields[key] = Field(value)
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            qtype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, rel))
        align = self.fields.get("general.alignment", Field(DEFAULT_ALIGNMENT)).value
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError("bad general.alignment")
        start = off + (-off % align)
        self.tensors: list[TensorInfo] = []
        names = set()
        for name, dims, qtype, rel in infos:
            if name in names:
                raise ValueError(f"duplicate tensor {name}")
            names.add(name)
            kind = gguf.GGMLQuantizationType(qtype)
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            n_bytes = n_elems * type_size // block
            np_dims = tuple(reversed(dims))
            dtype = PLAIN.get(kind.name)
            if dtype is None:
                dtype, count = np.uint8, n_bytes
                np_dims = gguf.quant_shape_to_byte_shape(np_dims, kind)
            else:
                count = n_elems
            at = start + rel
            if at + n_bytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(buf, dtype, count, at).reshape(np_dims)
            self.tensors.append(TensorInfo(name, kind, tuple(dims), n_bytes, at, data))


PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}


def _string(buf, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    if off + 8 + n > len(buf):
        raise ValueError("string past the end of the file")
    return buf[off + 8:off + 8 + n].decode("utf-8"), off + 8 + n


def _value(buf, off: int, vtype: int):
    if vtype == STRING:
        return _string(buf, off)
    if vtype in SCALARS:
        fmt = SCALARS[vtype]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if vtype != ARRAY:
        raise ValueError(f"unknown value type {vtype}")
    itype, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if itype == STRING:
        values = []
        for _ in range(count):
            s, off = _string(buf, off)
            values.append(s)
        return values, off
    if itype not in SCALARS:
        raise ValueError(f"unsupported array type {itype}")
    dtype = np.dtype(SCALARS[itype])
    if off + dtype.itemsize * count > len(buf):
        raise ValueError("array past the end of the file")
    return np.frombuffer(buf, dtype, count, off).tolist(), off + dtype.itemsize * count
