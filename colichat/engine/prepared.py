"""Prepared models: the dequantized weights of a GGUF cached on disk and memory-mapped on later starts.

The first start of a model parses its metadata with gguf-py (over a second for a large vocabulary)
and dequantizes its dense weights (seconds). Both results are kept in the cache directory:

    <cache_dir>/<key>/meta.json     config, tokenizer keys, array index, GGUF tensor locations
    <cache_dir>/<key>/weights.f32   the dense float32 arrays back to back, 64-byte aligned

key = a hash of the GGUF's real path, size, mtime and inode, and PREPARED_FORMAT: a GGUF that
changes gets a new key (and the old entries of that path are removed). A later start maps
weights.f32 read-only (no copy, no dequantizing) and the GGUF tensors it still needs (routed experts)
straight from the GGUF at their recorded offsets. An entry is written to a temporary directory and
renamed into place, so a crash or a full disk never leaves a half entry that would be trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .gguf import ModelConfig, TensorRecord, Tensors

PREPARED_FORMAT = 1
ALIGN = 64
FREE_MARGIN = 1 << 30  # bytes the weights cache leaves free on its disk


def _identity(path: str) -> tuple[str, str]:
    """(key, real path) of a GGUF file as it is now."""
    real = os.path.realpath(path)
    st = os.stat(real)
    raw = f"{PREPARED_FORMAT}\0{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24], real


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class Prepared:
    """A cache entry, mapped: `config`, `tokenizer_meta`, `weights` (name -> read-only array), and
    `tensors` (the GGUF's tensors, mapped from their files at the recorded offsets)."""

    def __init__(self, path: str, entry: Path):
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("format") != PREPARED_FORMAT:
            raise ValueError("old format")
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = {k: v for k, v in meta["config"].items() if k in fields}
        self.config = ModelConfig(**{**cfg, "path": path})
        self.tokenizer_meta = meta["tokenizer"]
        buf = _map(str(entry / "weights.f32"))
        self.weights = {
            name: np.frombuffer(buf, np.float32, int(np.prod(shape)), off).reshape(shape)
            for name, (off, shape) in meta["arrays"].items()
        }
        import gguf

        maps: dict[str, mmap.mmap] = {}
        records, files, offsets = [], {}, {}
        for name, qtype, ne, n_bytes, file, off, dtype, shape in meta["tensors"]:
            if file not in maps:
                maps[file] = _map(file)
            data = np.frombuffer(maps[file], np.dtype(dtype), int(np.prod(shape)), off).reshape(shape)
            records.append(TensorRecord(name, gguf.GGMLQuantizationType(qtype), tuple(ne), n_bytes, data))
            files[name], offsets[name] = file, off
        self.tensors = Tensors.from_records(path, records, files, offsets)


def load_prepared(path: str, cache_dir) -> Prepared | None:
    """The cache entry of this GGUF as it is now, or None (missing, stale or unreadable: prepare anew)."""
    try:
        key, real = _identity(path)
        entry = Path(cache_dir) / key
        if not (entry / "meta.json").is_file():
            return None
        return Prepared(real, entry)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None


def save_prepared(path: str, cache_dir, cfg: ModelConfig, tokenizer_meta: dict, weights: dict,
                  tensors: Tensors) -> str | None:
    """Write a cache entry; returns None, or a one-line reason it could not be written (never raises)."""
    try:
        key, real = _identity(path)
        root = Path(cache_dir)
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        need = sum(a.nbytes for a in weights.values())
        if shutil.disk_usage(root).free < need + FREE_MARGIN:  # never crowd out the sessions' disk
            return (f"not writing the weights cache: {need >> 20} MiB would leave less than "
                    f"{FREE_MARGIN >> 20} MiB free in {root}; each start dequantizes instead")
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    except OSError as e:
        return f"cannot write the weights cache ({e.strerror or e})"
    try:
        arrays, off = {}, 0
        with open(tmp / "weights.f32", "wb") as f:
            for name, a in weights.items():
                a = np.ascontiguousarray(a, dtype=np.float32)
                pad = -off % ALIGN
                f.write(b"\0" * pad)
                off += pad
                arrays[name] = [off, list(a.shape)]
                f.write(memoryview(a).cast("B"))
                off += a.nbytes
        records = [
            [t.name, int(t.tensor_type), [int(n) for n in t.shape], int(t.n_bytes),
             tensors.files[t.name], tensors.offsets[t.name], t.data.dtype.str, list(t.data.shape)]
            for t in tensors.by_name.values()
        ]
        meta = {
            "format": PREPARED_FORMAT,
            "gguf": real,
            "config": dataclasses.asdict(cfg),
            "tokenizer": {k: v for k, v in tokenizer_meta.items()
                          if k.startswith("tokenizer.") or k == "general.name"},
            "arrays": arrays,
            "tensors": records,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        entry = root / key
        if entry.exists():
            shutil.rmtree(entry, ignore_errors=True)
        os.rename(tmp, entry)
        _remove_stale(root, real, key)
        return None
    except (OSError, TypeError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"cannot write the weights cache ({getattr(e, 'strerror', None) or e})"


def _remove_stale(root: Path, real: str, keep: str) -> None:
    """Entries made from an earlier version of the same GGUF path are dead weight: remove them."""
    for entry in root.iterdir():
        if entry.name == keep or entry.name.startswith(".tmp-"):
            continue
        try:
            head = (entry / "meta.json").read_text()[:4096]
            if json.dumps(real) in head:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue
