"""Which model a session belongs to: its identity, and the weights fingerprint that tells fine-tunes
of one base model apart.

    ident = model_identity(gguf_path, arch, name, rope_factors=None)   # reads ~2 MB: {"arch", "name",
                                        # "fingerprint", "file", "path", "real_path"} (+ "rope_factors")
    weights_fingerprint(gguf_path) -> 32 hex digits
    model_dirname(ident)                # its session directory's name: the model as the screen names it
                                        # (`title`), sanitized, then 12 hex digits of the fingerprint
"""

from __future__ import annotations

import hashlib
import os
import re
import struct

from ..engine.gguf.header import HeaderError, read_header
from .kvfile import SessionError, oserror_text

TENSOR_SAMPLES, TENSOR_SAMPLE = 256, 4096  # a 4 KiB sample from the middle of up to 256 tensors
SPREAD_SAMPLES, SPREAD_SAMPLE = 16, 65536  # plus 16 x 64 KiB spread evenly over the data region


def _gguf_layout(buf: bytes) -> tuple[int, list[int]]:
    """(data region offset, sorted tensor offsets within it) from the start of a GGUF v2/v3 file.

    struct.error: `buf` is too short to hold the whole header; HeaderError: not a GGUF we can walk."""
    head = read_header(buf)
    if head.data_start > len(buf):
        raise struct.error("short")
    return head.data_start, sorted(t.offset for t in head.tensors)


def _read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def weights_fingerprint(path: str) -> str:
    """32 hex digits identifying a GGUF file's weights without reading it in full.

    Hashes the file size, the whole header (metadata + tensor infos), a 4 KiB sample from the middle
    of up to 256 tensors, and 16 x 64 KiB spread over the data region: ~2 MB read whatever the size.
    Two files of the same shapes with other weights (fine-tunes) differ in every sampled tensor."""
    h = hashlib.sha256(b"colichat weights fingerprint 1\0")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        n, layout = min(size, 1 << 20), None
        while layout is None:
            head = _read_at(f, 0, n)
            try:
                layout = _gguf_layout(head)
            except struct.error:
                if n >= min(size, 1 << 28):
                    break
                n = min(size, n * 4, 1 << 28)
            except HeaderError:
                break
        if layout is None:  # not a GGUF we can walk: hash its start and the spread samples
            data_start, starts = min(size, 1 << 20), []
            h.update(head[:data_start])
        else:
            data_start = layout[0]
            h.update(head[:data_start])
            starts = [data_start + o for o in layout[1]]
        ends = starts[1:] + [size] if starts else []  # no tensors (or not walkable): no tensor samples
        step = max(1, -(-len(starts) // TENSOR_SAMPLES))
        for s, e in list(zip(starts, ends, strict=True))[::step]:
            e = min(e, size)
            if e > s:
                mid = max(s, (s + e - TENSOR_SAMPLE) // 2)
                h.update(_read_at(f, mid, min(TENSOR_SAMPLE, e - mid)))
        span = max(0, size - data_start - SPREAD_SAMPLE)
        for k in range(SPREAD_SAMPLES):
            h.update(_read_at(f, data_start + span * k // (SPREAD_SAMPLES - 1), SPREAD_SAMPLE))
    return h.hexdigest()[:32]


def model_identity(gguf_path: str, arch: str, name: str, rope_factors: str | None = None) -> dict:
    """What a session records about its model: {"arch", "name", "fingerprint", "file", "path",
    "real_path"} ("file": the GGUF's file name, for listings; "path": its absolute path as given, and
    "real_path": the file it led to, symbolic links resolved, to find the model again when the session
    is reopened without --model, also once a link given points to another file; these never
    compared), and "rope_factors" (the rope frequency factors the cache rows are rotated with,
    Model.rope_factors) where the architecture picks them by context size."""
    try:
        fp = weights_fingerprint(str(gguf_path))
    except OSError as e:
        raise SessionError(f"cannot fingerprint model {gguf_path}: {oserror_text(e)}") from None
    path = os.path.abspath(str(gguf_path))
    ident = {"arch": str(arch), "name": str(name), "fingerprint": fp, "file": os.path.basename(path), "path": path,
             "real_path": os.path.realpath(path)}
    return ident if rope_factors is None else {**ident, "rope_factors": str(rope_factors)}


def dir_suffix(fingerprint: str) -> str:
    """The end of the name of a model's session directory: 12 hex digits of its weights fingerprint."""
    return "-" + fingerprint[:12]


def title(name: str, path: str) -> str:
    """The model in a few words, as every screen names it (models.model_title shows it): its general.name
    when that is short, else the file's name without .gguf (`path` may be the name alone; empty when not
    known: the name then)."""
    file = os.path.basename(path)
    stem = file[:-5] if file.lower().endswith(".gguf") else file
    return name if not stem or (name and name != file and len(name.split()) <= 4 and len(name) <= 40) else stem


def model_dirname(ident: dict) -> str:
    """The model's session directory's name: the model as the screen names it (`title`; else its
    architecture), sanitized, then `dir_suffix`. Directories named otherwise by an older colichat (from
    general.name alone) are found by their suffix (Store.model_dir)."""
    named = title(str(ident.get("name") or ""), str(ident.get("file") or ""))
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", named).strip("-.")[:40]
    return f"{base or ident.get('arch') or 'model'}{dir_suffix(ident['fingerprint'])}"
