"""`colichat --models`: the GGUF models colichat knows of, one line per file, named as --model takes them.

    PATH.gguf: llama Q4_1, 93.8 MiB, runs (513.1 MiB of weights as f32); colichat's cache: 513.1 MiB
    hf:OWNER/REPO/FILE.gguf: deepseek2 Q4_K_M, 10.4 GiB, does not run: its weights need ... as f32 but only ...

Known: the models saved conversations were made with (the paths their sessions recorded, newest
conversation first), the default model, and the GGUFs in the Hugging Face cache (hub.cached_models); one
file (its links resolved) is listed once, by its hf: name where it is in that cache. What a line says
comes from the file's header alone (nothing is loaded): the architecture and quant type (as the file's
name says it, else its general.file_type), the size (every part of a split model), whether it runs here
by the rule loading applies (engine.check_headers: an architecture colichat runs, dense weights that fit
in the memory available as f32), and the disk colichat's weights cache holds for it (its dequantized
weights, which later starts map: deleting them is safe).
"""

from __future__ import annotations

import os
import re
import struct

import gguf

from ..engine import ModelError, check_headers, file_headers
from ..engine import f32_bytes_but_experts as dense_bytes
from ..engine.gguf.header import HeaderError
from ..engine.gguf.prepared import entry_of
from ..paths import paths
from ..persist import Store
from ..units import format_size
from ..wrap import displayable
from .default import DefaultModelMissing, default_model_path
from .hub import SPLIT_RE, cached_models, quant_of

HUB_PATH = re.compile(r".*/models--(?P<owner>[^/]+?)--(?P<repo>[^/]+)/snapshots/[^/]+/(?P<file>[^\0]+\.gguf)$", re.I)
NO_MODELS = "no models yet: colichat --model hf:OWNER/REPO:QUANT downloads one (README.md, Getting a real model)\n"


def model_rows(store: Store) -> list[str]:
    """One line per model known (see the module's docstring), used ones first."""
    in_cache = {os.path.realpath(m.path): m for m in cached_models()}
    known: list[tuple[str, str]] = []  # (path, mark)
    for info in store.list():
        path = next((p for p in info.model_paths() if os.path.isfile(p)), None)
        if path:
            known.append((path, ""))
    try:
        known.append((default_model_path(verify=False), " (default)"))
    except DefaultModelMissing:
        pass
    known += [(m.path, "") for m in in_cache.values()]
    rows, seen = [], set()
    for path, mark in known:
        real = os.path.realpath(path)
        hub = in_cache.get(real)
        spec = hub.spec if hub else hub_name(path)  # (one file of the hub's cache, however it was reached)
        if real in seen or (spec and spec in seen):
            continue
        seen |= {real, spec or real}
        if hub is not None and hub.present < hub.parts:
            rows.append(f"{hub.spec}: {format_size(hub.size)}, incomplete: {hub.present} of {hub.parts} parts "
                        f"downloaded (colichat --model {hub.spec} downloads the rest)")
            continue
        name = spec or path
        size = hub.size if hub else _size(path)
        rows.append(displayable(f"{name}{mark}: {about(name, path, size)}"))
    return rows


def hub_name(path: str) -> str | None:
    """hf:OWNER/REPO/FILE.gguf for a file of a Hugging Face cache (models--OWNER--REPO/snapshots/REV/FILE),
    whichever revision or cache it is in; None for any other path."""
    m = HUB_PATH.match(path)
    return f"hf:{m['owner']}/{m['repo']}/{m['file']}" if m else None


def about(name: str, path: str, size: int) -> str:
    """'llama Q4_1, 93.8 MiB, runs (513.1 MiB of weights as f32); colichat's cache: 513.1 MiB', or why it
    does not run here."""
    try:
        heads = file_headers(path)
    except (OSError, HeaderError, struct.error, ModelError):
        return f"{format_size(size)}, does not run: not a GGUF file colichat can read (damaged, or a part missing)"
    what = f"{heads[0].kv.get('general.architecture')} {quant(path, heads[0].kv)}"
    cached = cache_bytes(path)
    kept = f"; colichat's cache: {format_size(cached)}" if cached else ""
    try:
        check_headers(name, heads)
    except ModelError as e:
        return f"{what}, {format_size(size)}, does not run: {str(e).removeprefix(name + ': ')}{kept}"
    need = dense_bytes((t.name, t.shape) for h in heads for t in h.tensors)
    kept = kept or "; colichat's cache: none yet (the first start fills it)"
    return f"{what}, {format_size(size)}, runs ({format_size(need)} of weights as f32){kept}"


def quant(path: str, kv: dict) -> str:
    """The quant type of a GGUF: as its file's name says it (Q4_K_M, UD-Q4_K_XL), else its general.file_type
    (llama.cpp's names), else '?'."""
    named = quant_of(path)
    if named:
        return named
    names = {t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in gguf.LlamaFileType}
    return names.get(kv.get("general.file_type"), "?")


def cache_bytes(path: str) -> int:
    """Bytes colichat's weights cache holds for the GGUF `path` as it is now (its dequantized weights and
    expert use counts: engine/gguf/prepared.py), 0 if none."""
    entries = (entry_of(path, paths().cache / "weights", kernels) for kernels in ("numba", "numpy"))  # either path's
    return sum(f.stat().st_size for entry in entries if entry for f in entry.iterdir() if f.is_file())


def _size(path: str) -> int:
    """Bytes of the GGUF `path`, with the other parts of a split model beside it."""
    m = SPLIT_RE.match(os.path.basename(path))
    if m is None:
        return os.path.getsize(path)
    d = os.path.dirname(path)
    parts = (os.path.join(d, f"{m['stem']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, int(m["n"]) + 1))
    return sum(os.path.getsize(p) for p in parts if os.path.isfile(p))
