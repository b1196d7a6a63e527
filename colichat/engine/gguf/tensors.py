"""Open a GGUF file (each part of a split model): its metadata fields, its tensors by GGUF name,
dequantized on request, and the trained context from the header alone.

Shapes: gguf-py reports `ReaderTensor.shape` in ggml order (ne); we only ever use numpy shapes,
which are `reversed(ne)`: a linear layer `[in, out]` in GGUF is `(out, in)` here, and `y = W @ x`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from typing import NamedTuple

import numpy as np

from ...errors import ModelError
from ..config import MIN_CTX
from . import dequant, kernels
from .file import GGUFFile, Truncated, madvise, populate
from .header import HeaderError, read_header
from .qmatrix import QMatrix


def open_gguf(path: str):
    """Memory-map a GGUF file; any problem becomes a one-line ModelError naming the file.

    For a split model (-0000N-of-0000M.gguf) this returns the first part, which holds the metadata;
    Tensors opens the other parts.
    """
    reader = _open_one(path)
    if int(field(reader, "split.count", 0) or 0) > 1 and int(field(reader, "split.no", 0) or 0) != 0:
        reader = _open_one(shard_paths(path, reader)[0])
    return reader


def trained_context(path: str) -> int | None:
    """The context the model of GGUF `path` was trained for ({arch}.context_length: the most load()
    gives), from its metadata alone (the header walked without its tensors: milliseconds, before a
    load that can take minutes); None where the file does not say it plainly (loading says why)."""
    keep = ("general.architecture", "split.count", "split.no")
    try:
        kv = _metadata_keys(path, keep)
        count, no = kv.get("split.count"), kv.get("split.no")
        if type(count) is int and count > 1 and type(no) is int and no != 0:
            kv = _metadata_keys(_part_paths(path, count)[0], keep)  # the first part holds it
        arch = kv.get("general.architecture")
        n = kv.get(f"{arch}.context_length") if isinstance(arch, str) else None
        n = scalar(n) if isinstance(n, list) else n
    except (OSError, UnicodeDecodeError, HeaderError, ModelError, struct.error):  # (a short file, an odd value)
        return None
    return n if type(n) is int and n >= MIN_CTX else None


def _metadata_keys(path: str, keys: tuple) -> dict:
    """The keys `keys` and any *.context_length of GGUF `path`'s header (no tensors read)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file
            raise HeaderError("an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read_header(buf, lambda key: key in keys or key.endswith(".context_length"), tensors=False).kv


def file_headers(path: str) -> list:
    """The headers (header.Header, tensor infos included) of GGUF `path` and, for a split model, of
    every part (found from `path`'s name and split.count): what can be said of a model without loading
    it. OSError, HeaderError or struct.error (a short or damaged file), ModelError (a part misnamed)."""
    heads = [_file_header(path)]
    count = heads[0].kv.get("split.count")
    if type(count) is int and count > 1:
        parts = _part_paths(path, count)
        heads = [heads[0] if p == path else _file_header(p) for p in parts]
    return heads


def _file_header(path: str):
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file
            raise HeaderError("an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read_header(buf, lambda key: key in ("general.architecture", "general.file_type", "split.count",
                                                        "split.no"))


def shard_paths(path: str, reader) -> list[str]:
    """Every part of a split GGUF, in order (llama.cpp's gguf-split naming), or [path]."""
    n = int(field(reader, "split.count", 0) or 0)
    if n <= 1:
        return [path]
    return _part_paths(path, n)


def _part_paths(path: str, n: int) -> list[str]:
    """The `n` parts of the split GGUF `path` is one of (ModelError if it is not named like one)."""
    m = re.match(r"^(.*)-\d{5}-of-\d{5}\.gguf$", path)
    if m is None:
        raise ModelError(f"{path}: part of a {n}-part GGUF, but not named like NAME-00001-of-{n:05d}.gguf")
    return [f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def _open_one(path: str):
    import gguf

    if not os.path.exists(path):
        raise ModelError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelError(f"{path}: is a directory, not a GGUF file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"{path}: cannot read ({e.strerror})") from None
    if magic != b"GGUF":
        raise ModelError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        return GGUFFile(path)  # a well-formed file, read in one pass (file.py)
    except Truncated as e:
        raise ModelError(f"{path}: truncated GGUF file: {e} (a download cut short?)") from None
    except (HeaderError, OverflowError, ValueError):  # not what it understands (a length beyond any file,
        pass                                            # a shape numpy cannot take): gguf-py says what is wrong
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/... on damaged files
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"{path}: damaged or truncated GGUF file: its header cannot be read ({msg}); "
                         "download it again") from None
    reader.path = path  # for messages and for finding the other parts of a split model
    return reader


def field(reader, key: str, default=None, required: bool = False):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelError(f"{reader.path}: missing GGUF key '{key}'")
        return default
    try:
        return f.contents()
    except UnicodeDecodeError:
        raise ModelError(f"{reader.path}: damaged GGUF file: the value of {key} is not UTF-8 text; "
                         "download it again") from None


def scalar(v):
    """Per-layer array keys (u32[L]) collapse to their first value; colichat needs uniform layers."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ModelError(f"per-layer varying hyper-parameters are not supported ({v[:4]}...)")
        return v[0]
    return v


def _identity(path: str) -> tuple | None:
    """(device, inode, size, mtime) of file `path`, or None where it cannot be found."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class TensorRecord(NamedTuple):
    """One GGUF tensor as Tensors needs it (gguf-py's ReaderTensor has these fields too)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple         # ggml order (ne)
    n_bytes: int
    data: np.ndarray     # the raw data, memory-mapped, numpy layout


class Tensors:
    """GGUF tensors by name; `f32(name)` dequantizes one tensor (or one expert) on request, `qmatrix(name)`
    gives it as the file holds it (a QMatrix over the map: nothing read or copied).

    `files[name]` and `offsets[name]` say where each tensor's data lies (its file may be one part
    of a split model), so a prepared model can map it again without parsing the GGUF.

    `kernels`: whether `matrix(name)`, what an architecture's prepare asks for a weight only `linear`
    multiplies by, stays quantized (a QMatrix, where the compiled kernels take its type) or is f32 (the
    numpy path). Set by engine.load.
    """

    kernels = False

    def __init__(self, reader, path: str):
        tensors = list(reader.tensors)
        files = {t.name: str(reader.path) for t in tensors}
        parts = shard_paths(str(reader.path), reader)
        for part in parts[1:]:  # a split model: the first part was opened by open_gguf
            more = _open_one(part).tensors
            tensors += more
            files.update({t.name: part for t in more})
        expected = field(reader, "split.tensors.count")
        if len(parts) > 1 and expected is not None and int(expected) != len(tensors):
            raise ModelError(f"{path}: the {len(parts)} parts hold {len(tensors)} tensors, expected {expected}")
        self._init(path, tensors, files, {t.name: int(t.data_offset) for t in tensors})

    def page_in(self, stopped, chunk: int = 64 << 20) -> None:
        """Map every tensor's pages now, in file order and chunks of `chunk` bytes (file.populate), until
        `stopped` (a threading.Event) is set or the system refuses: run on a thread of its own after load, so
        that the first prompt's products do not fault the file in 4 KiB at a time (the V2-Lite-shaped 11.9
        GB file, in the page cache: 2.5 s this way against about 20 s of faults inside the first prefill)."""
        advise = madvise()
        for t in sorted(self.by_name.values(), key=lambda t: (self.files[t.name], self.offsets[t.name])):
            flat = t.data.reshape(-1).view(np.uint8)
            for at in range(0, flat.size, chunk):
                if advise is None or stopped.is_set() or not populate(flat[at : at + chunk], advise):
                    return

    @classmethod
    def from_records(cls, path: str, records: list[TensorRecord], files: dict, offsets: dict) -> Tensors:
        self = cls.__new__(cls)
        self._init(path, records, files, offsets)
        return self

    def _init(self, path: str, tensors: list, files: dict, offsets: dict) -> None:
        import gguf

        self.path = path
        self.files, self.offsets = files, offsets
        self.loaded = {file: _identity(file) for file in dict.fromkeys(files.values())}  # as mapped: whole()
        self.by_name = {t.name: t for t in tensors}
        supported = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
        supported |= set(getattr(gguf.quants, "_type_traits", {}))
        for t in tensors:
            if t.tensor_type not in supported:
                raise ModelError(
                    f"{path}: tensor {t.name} has quant type {t.tensor_type.name}, "
                    "which colichat cannot dequantize; use a file with another quant type"
                )

    def whole(self) -> str | None:
        """Check that the files the tensors are mapped from are still the ones loaded (a stat of each:
        cheap enough before every pass). A file cut short in place would kill colichat at the next read
        of a lost page (SIGBUS, which Python cannot catch), and one rewritten in place shows its new bytes
        through the map: ModelError, before anything is read. A file replaced (another file at its path)
        or deleted stays mapped as it was: the run goes on with it, and this returns a one-line note the
        first time it finds that (None otherwise)."""
        note = None
        for file, was in self.loaded.items():
            now = _identity(file)
            if was is None or now == was:
                continue
            if now is not None and now[:2] == was[:2]:  # the same file (device, inode), changed in place
                if now[2] < was[2]:
                    raise ModelError(f"the model file {file} was cut short while colichat ran ({now[2]:,} bytes, "
                                     f"was {was[2]:,}): restart colichat with a whole file")
                raise ModelError(f"the model file {file} was rewritten while colichat ran: restart colichat "
                                 "to load it as it is now")
            self.loaded[file] = None  # (said once)
            note = (f"note: the model file {file} was {'deleted' if now is None else 'replaced'} while colichat "
                    "ran; this run goes on with the file as it was loaded")
        return note

    def has(self, name: str) -> bool:
        return name in self.by_name

    def require(self, name: str):
        t = self.by_name.get(name)
        if t is None:
            raise ModelError(f"{self.path}: missing tensor '{name}'")
        return t

    def qtype(self, name: str):
        return self.require(name).tensor_type

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape (reversed ggml ne)."""
        return tuple(int(n) for n in reversed(self.require(name).shape))

    def f32(self, name: str, expert: int | None = None) -> np.ndarray:
        """Dequantized float32 array in numpy layout; `expert` slices one expert of a 3-D *_exps tensor."""
        import gguf

        t = self.require(name)
        data = t.data if expert is None else t.data[expert]
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            out = np.asarray(data, dtype=np.float32)
        elif t.tensor_type.name in dequant.FAST:
            out = dequant.FAST[t.tensor_type.name](data)
        else:
            out = gguf.quants.dequantize(data, t.tensor_type)
        shape = self.shape(name) if expert is None else self.shape(name)[1:]
        return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)

    def qmatrix(self, name: str, expert: int | None = None) -> QMatrix:
        """Tensor `name` (2-D, or one expert of a 3-D *_exps tensor) as the QMatrix (O, Z) of its blocks."""
        t = self.require(name)
        data = t.data if expert is None else t.data[expert]
        o, z = self.shape(name)[-2:]
        return QMatrix([(t.tensor_type.name, data.reshape(o, -1), (name, expert))], z)

    def matrix(self, name: str, expert: int | None = None) -> QMatrix | np.ndarray:
        """A weight only ops.linear multiplies by: a QMatrix where `kernels` is set and they take its type
        (F32 stays the f32 array it is), else f32."""
        kind = self.qtype(name).name
        if self.kernels and kind != "F32" and kernels.supported(kind):
            return self.qmatrix(name, expert)
        return self.f32(name, expert)

    def get(self, name: str, shape: tuple, matrix: bool = False) -> QMatrix | np.ndarray:
        """Tensor `name`, checked to have numpy shape `shape`: f32, or `matrix(name)` if `matrix`."""
        self.check(name, shape)
        return self.matrix(name) if matrix else self.f32(name)

    def nbytes(self, name: str) -> int:
        return int(self.require(name).n_bytes)

    def check(self, name: str, shape: tuple) -> str:
        """Require tensor `name` with numpy shape `shape` (without reading it); returns the name."""
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelError(f"{self.path}: tensor '{name}' has shape {got}, expected {tuple(shape)}")
        return name
