"""Prepared models: the f32 weights of a GGUF cached on disk and memory-mapped on later starts.

The first start of a model parses its metadata (file.py) and prepares its dense weights (seconds).
Both results are kept in the cache directory:

    <cache_dir>/<key>/meta.json     a SHA-256 line of the JSON below it, then the JSON: config,
                                    tokenizer keys, array index (offset, shape, CRC-32s), the quantized
                                    matrices (their tensors and experts), GGUF tensor locations
    <cache_dir>/<key>/weights.f32   the f32 arrays back to back, 64-byte aligned
    <cache_dir>/<key>/usage.npy     MoE models: how much each routed expert was used lately (float32,
                                    (L X,)), rewritten after every answer; a start warms the most used
                                    (ffn.ExpertCache.warm). A hint only: one that is unreadable is ignored

meta.json and usage.npy are read as hints are (hints.py): without blocking, size-capped, any damage one
line. A meta.json that cannot be used makes its entry damaged; usage.npy's counts are then only ignored.

What weights.f32 holds depends on the path (engine.load's `kernels`), and each path has its own entry:
- "numpy": every dense weight dequantized to f32 (the numpy engine multiplies only f32);
- "numba": only what stays f32 there: norms, biases, routers, MLA's k_b/v_b (absorbed into the
  attention), the tensors the file keeps in F32, and matrices of a type the kernels do not take. The
  quantized matrices (QMatrix) are not copied: meta.json names their tensors, and a later start takes
  them from the GGUF's map again (a few KiB per model where the old format held gigabytes).

key = a hash of the GGUF's real path, size, mtime and inode, the path, and PREPARED_FORMAT: a GGUF
that changes gets new keys (and the old entries of that GGUF path, the old format's among them, are
removed when the new one is written; each path's current entry is kept). A later start maps
weights.f32 read-only (no copy, no dequantizing) and the GGUF tensors it still needs (routed experts,
quantized matrices) straight from the GGUF at their recorded offsets. An entry is written to a temporary directory
(.tmp-<pid>-*), fsynced, and renamed into place, so a crash or a full disk never leaves a half entry
that would be trusted; temporary directories of processes that died are removed by the next start.
Starts of one model at once each write an entry: the first renamed into place is kept, and the
others, finding it there and sound, drop theirs.

Every start verifies the entry before using it: meta.json against its SHA-256, weights.f32's size,
and each array's CRC-32 (the whole array when the entry holds at most FULL_CHECK_BYTES, else three
SAMPLE-byte pieces of it, so a start stays well under a second). A damaged entry is never used: the
start dequantizes again, rewrites the entry, and says so.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ...errors import ModelError
from ...hints import read_hint
from ...paths import private_dir, private_file

try:  # the same CRC-32 as zlib.crc32, several times faster
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives identical values
    from zlib import crc32

from ..config import ModelConfig
from .qmatrix import QMatrix, stack
from .tensors import TensorRecord, Tensors

PREPARED_FORMAT = 4  # 3: the config has the model's sampling defaults; 4: an entry per kernel path, QMatrix by name
KERNEL_PATHS = ("numba", "numpy")
ALIGN = 64
FREE_MARGIN = 1 << 30  # bytes the weights cache leaves free on its disk
FULL_CHECK_BYTES = 1 << 30  # entries up to this size are checked in full at every start (~0.3 s)
SAMPLE = 1 << 16  # larger ones: three pieces of this size per array (start, middle, end)
USAGE = "usage.npy"
META_LIMIT = 1 << 28  # bytes of a meta.json read at most (the tokenizer's vocabulary and merges are in it)
USAGE_LIMIT = 1 << 24  # bytes of a usage.npy read at most (a count per layer and expert)


class DamagedEntry(Exception):
    """A cache entry that fails its checks; the message says which check."""


def _crcs(a: np.ndarray, whole: bool = True) -> tuple[int | None, int]:
    """(CRC-32 of the whole array's bytes (None unless `whole`), CRC-32 of its start, middle and
    end pieces of SAMPLE bytes; the whole array when it is not larger than the three)."""
    b = memoryview(np.ascontiguousarray(a)).cast("B")
    n = len(b)
    if n <= 3 * SAMPLE:
        c = crc32(b)
        return c, c
    mid = (n - SAMPLE) // 2
    part = crc32(b[n - SAMPLE :], crc32(b[mid : mid + SAMPLE], crc32(b[:SAMPLE])))
    return (crc32(b) if whole else None), part


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dead_tmp(root: Path) -> None:
    """Remove temporary entries (.tmp-<pid>-*) whose writing process no longer runs."""
    try:
        names = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    except OSError:
        return
    for tmp in names:
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
                continue  # still running: it may be writing this entry right now
            except ProcessLookupError:
                pass
            except OSError:  # another user's process (EPERM): alive
                continue
        elif pid.isdigit():
            continue  # ours
        shutil.rmtree(tmp, ignore_errors=True)


def _identity(path: str, kernels: str) -> tuple[str, str]:
    """(key, real path) of a GGUF file as it is now, prepared for the kernel path `kernels`."""
    real = os.path.realpath(path)
    st = os.stat(real)
    raw = f"{PREPARED_FORMAT}\0{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    if kernels != "numpy":  # (the numpy path's key is the one it always had)
        raw += f"\0{kernels}"
    return hashlib.sha256(raw.encode("utf-8", "surrogateescape")).hexdigest()[:24], real


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class Prepared:
    """A cache entry, mapped: `config`, `tokenizer_meta`, `weights` (name -> read-only array), and
    `tensors` (the GGUF's tensors, mapped from their files at the recorded offsets)."""

    def __init__(self, path: str, entry: Path, given: str | None = None):
        """`path`: the GGUF file (links resolved), whose tensors are mapped; `given`: the path the
        model was given by, which the config names (a link stays the link: sessions record it)."""
        meta, problem = read_hint(entry / "meta.json", _meta, META_LIMIT)
        if meta is None:
            raise DamagedEntry(f"meta.json: {problem or 'missing'}")
        if meta.get("format") != PREPARED_FORMAT or meta.get("kernels") not in KERNEL_PATHS:
            raise DamagedEntry("meta.json is not what this colichat wrote")
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = {k: v for k, v in meta["config"].items() if k in fields}
        named = path if given is None else given
        if cfg["name"] == os.path.basename(cfg["path"]):  # no general.name: named after the path given
            cfg["name"] = os.path.basename(named)  # now, as load_config names it (a link stays the link)
        cfg["sampling"] = tuple(tuple(pair) for pair in cfg.get("sampling", ()))  # (JSON made them lists)
        self.config = ModelConfig(**{**cfg, "path": named})
        self.tokenizer_meta = meta["tokenizer"]
        size = os.path.getsize(entry / "weights.f32")
        if size != meta["weights_bytes"]:
            raise DamagedEntry(f"weights.f32 holds {size:,} bytes, not {meta['weights_bytes']:,}")
        buf = _map(str(entry / "weights.f32"))
        full = meta["weights_bytes"] <= FULL_CHECK_BYTES
        self.weights = {}
        for name, (off, shape, whole, part) in meta["arrays"].items():
            a = np.frombuffer(buf, np.float32, int(np.prod(shape)), off).reshape(shape)
            if _crcs(a, full)[0 if full else 1] != (whole if full else part):
                raise DamagedEntry(f"array {name} does not match its checksum")
            self.weights[name] = a
        import gguf

        maps: dict[str, mmap.mmap] = {}
        records, files, offsets = [], {}, {}
        for name, qtype, ne, n_bytes, file, off, dtype, shape in meta["tensors"]:
            if not os.path.isabs(file):  # (an older colichat's entry: relative to a directory it does not say)
                raise DamagedEntry(f"it names {file} by a relative path")
            if file not in maps:
                maps[file] = _map(file)
            if off + np.dtype(dtype).itemsize * int(np.prod(shape)) > len(maps[file]):
                raise DamagedEntry(f"{file} is shorter than when the entry was written")
            data = np.frombuffer(maps[file], np.dtype(dtype), int(np.prod(shape)), off).reshape(shape)
            records.append(TensorRecord(name, gguf.GGMLQuantizationType(qtype), tuple(ne), n_bytes, data))
            files[name], offsets[name] = file, off
        self.tensors = Tensors.from_records(path, records, files, offsets)
        self.tensors.kernels = meta["kernels"] == "numba"
        for name, sources in meta["matrices"].items():  # views of the GGUF's map, as prepare made them
            try:
                self.weights[name] = stack([self.tensors.qmatrix(t, e) for t, e in sources])
            except (ModelError, ValueError, IndexError) as e:
                raise DamagedEntry(f"matrix {name} does not match the GGUF ({e})") from None


def _meta(raw: bytes) -> dict:
    """meta.json's JSON (ValueError: it does not match its checksum, or is not a JSON object)."""
    digest, _, body = raw.partition(b"\n")
    if digest.decode("ascii", "replace") != hashlib.sha256(body).hexdigest():
        raise ValueError("does not match its checksum")
    meta = json.loads(body)  # its checksum holds: what save_prepared wrote, in some format
    if not isinstance(meta, dict):
        raise ValueError("not what this colichat wrote")
    return meta


def load_prepared(path: str, cache_dir, on_note=None, kernels: str = "numba") -> Prepared | None:
    """The cache entry of this GGUF as it is now, for the kernel path `kernels`, or None (missing, stale,
    unreadable or damaged: prepare anew). A damaged entry is removed and `on_note(line)` told why."""
    _remove_dead_tmp(Path(cache_dir))
    try:
        key, real = _identity(path, kernels)
        entry = Path(cache_dir) / key
        if not os.path.lexists(entry):  # (nor where the cache directory cannot be read: it is not used)
            return None
        return Prepared(real, entry, given=path)
    except DamagedEntry as e:
        shutil.rmtree(entry, ignore_errors=True)
        if on_note:
            on_note(f"the dequantized-weights cache {entry} was damaged ({e}); dequantizing again")
        return None
    except OSError:
        return None


def save_prepared(path: str, cache_dir, cfg: ModelConfig, tokenizer_meta: dict, weights: dict,
                  tensors: Tensors, kernels: str = "numba") -> str | None:
    """Write a cache entry of the weights prepared for the kernel path `kernels`: the f32 arrays, and the
    tensors of each QMatrix; returns None, or a one-line reason it could not be written (never raises)."""
    root = Path(cache_dir)
    matrices = {name: [list(p.source) for p in w.parts] for name, w in weights.items() if isinstance(w, QMatrix)}
    weights = {name: w for name, w in weights.items() if name not in matrices}
    try:
        key, real = _identity(path, kernels)
        private_dir(root)
        need = sum(a.nbytes for a in weights.values())
        if shutil.disk_usage(root).free < need + FREE_MARGIN:  # never crowd out the sessions' disk
            return (f"not writing the weights cache: {need >> 20} MiB would leave less than "
                    f"{FREE_MARGIN >> 20} MiB free in {root}; each start dequantizes instead")
        _remove_dead_tmp(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{os.getpid()}-", dir=root))
    except OSError as e:
        return _unwritable(root, e)
    try:
        arrays, off = {}, 0
        with open(tmp / "weights.f32", "wb", opener=private_file) as f:
            for name, a in weights.items():
                a = np.ascontiguousarray(a, dtype=np.float32)
                pad = -off % ALIGN
                f.write(b"\0" * pad)
                off += pad
                arrays[name] = [off, list(a.shape), *_crcs(a)]
                f.write(memoryview(a).cast("B"))
                off += a.nbytes
            f.flush()
            os.fsync(f.fileno())
        records = [
            [t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.n_bytes),
             os.path.realpath(tensors.files[t.name]), tensors.offsets[t.name], t.data.dtype.str, list(t.data.shape)]
            for t in tensors.by_name.values()
        ]
        meta = {
            "format": PREPARED_FORMAT,
            "gguf": real,
            "kernels": kernels,
            "config": dataclasses.asdict(cfg),
            "tokenizer": {k: v for k, v in tokenizer_meta.items()
                          if k.startswith("tokenizer.") or k == "general.name"},
            "weights_bytes": off,
            "arrays": arrays,
            "matrices": matrices,
            "tensors": records,
        }
        body = json.dumps(meta).encode()
        with open(tmp / "meta.json", "wb", opener=private_file) as f:
            f.write(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        _put_in_place(tmp, root / key, real, kernels)
        _fsync_dir(root)
        _remove_stale(root, real, {_identity(path, k)[0] for k in KERNEL_PATHS})
        return None
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return _unwritable(root, e)


def entry_of(path: str, cache_dir, kernels: str = "numba") -> Path | None:
    """The cache entry directory of this GGUF as it is now, for the kernel path `kernels`, if there is one."""
    try:
        entry = Path(cache_dir) / _identity(path, kernels)[0]
        return entry if os.path.isfile(entry / "meta.json") else None
    except OSError:  # (a cache directory that cannot be read: PermissionError)
        return None


def read_usage(entry: Path, on_note=None) -> np.ndarray | None:
    """The expert use counts kept in `entry` (write_usage), or None (none kept, or unusable: `on_note`
    told why; the next answer writes them anew)."""
    counts, problem = read_hint(entry / USAGE, _counts, USAGE_LIMIT)
    if problem and on_note:
        on_note(f"the experts' use counts {entry / USAGE} cannot be used ({problem}): ignored, and written anew "
                "after the next answer")
    return counts


def _counts(raw: bytes) -> np.ndarray:
    """usage.npy's counts (L X,) (ValueError: not a float32 vector in .npy format)."""
    counts = np.load(io.BytesIO(raw), allow_pickle=False)
    if not (isinstance(counts, np.ndarray) and counts.dtype == np.float32 and counts.ndim == 1):
        raise ValueError("not a float32 vector")
    return counts


def write_usage(entry: Path, counts: np.ndarray) -> None:
    """Keep expert use counts (L X,) in `entry`, replacing the last ones whole; a failure (full disk,
    the entry removed) only loses the hint: never raises."""
    tmp = entry / f".{USAGE}.{os.getpid()}"
    try:
        with open(tmp, "wb", opener=private_file) as f:
            np.save(f, np.asarray(counts, dtype=np.float32), allow_pickle=False)
        os.replace(tmp, entry / USAGE)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _put_in_place(tmp: Path, entry: Path, real: str, kernels: str) -> None:
    """Rename the written entry `tmp` to `entry`. One already there is either another start's, of
    the same GGUF, renamed while this one dequantized (as good as ours: ours is dropped), or one
    load_prepared could not use (replaced)."""
    for _ in range(2):
        try:
            os.rename(tmp, entry)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if _sound(entry, real, kernels):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        shutil.rmtree(entry, ignore_errors=True)
    raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), str(entry))


def _sound(entry: Path, real: str, kernels: str) -> bool:
    """Whether the entry passes the checks a start makes before using it (for the kernel path `kernels`)."""
    try:
        if Prepared(real, entry).tensors.kernels != (kernels == "numba"):
            return False
    except (DamagedEntry, OSError):
        return False
    return True


def _unwritable(root: Path, e: OSError) -> str:
    return (f"cannot write the weights cache in {root} ({getattr(e, 'strerror', None) or e}); "
            "each start dequantizes instead")


def _remove_stale(root: Path, real: str, keep: set[str]) -> None:
    """Entries of the same GGUF path but those `keep` (each kernel path's, of the GGUF as it is now) are
    dead weight (an earlier version of the file, an older format): remove them."""
    for entry in root.iterdir():
        if entry.name in keep or entry.name.startswith(".tmp-"):
            continue
        head = read_hint(entry / "meta.json", lambda raw: raw[:4096].decode("utf-8", "replace"), META_LIMIT).value
        if head is not None and json.dumps(real) in head:
            shutil.rmtree(entry, ignore_errors=True)
