"""`colichat --models`: the GGUF models colichat knows of, one line each, named as --model takes them.

    PATH.gguf: llama, 9.0 MiB, runs (36 MiB of weights as f32)
    hf:OWNER/REPO/FILE.gguf: deepseek2, 10.4 GiB, does not run: its weights need ... as f32 but only ...

Known: the models saved conversations were made with (the paths their sessions recorded, newest
conversation first), the default model, and the GGUFs in the Hugging Face cache (hub.cached_models); one
file is listed once, by its hf: name where it is in that cache. What a line says comes from the file's
header alone (nothing is loaded): the architecture, the size (every part of a split model), and whether
it runs here by the rule loading applies (engine.check_headers: an architecture colichat runs, dense
weights that fit in the memory available as f32).
"""

from __future__ import annotations

import os
import struct

from .engine import ModelError, check_headers, file_headers
from .engine import f32_bytes_but_experts as dense_bytes
from .engine.gguf.header import HeaderError
from .hub import SPLIT_RE, cached_models
from .models import DefaultModelMissing, default_model_path
from .persist import Store
from .units import format_size
from .wrap import displayable

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
        if real in seen:
            continue
        seen.add(real)
        hub = in_cache.get(real)
        if hub is not None and hub.present < hub.parts:
            rows.append(f"{hub.spec}: {format_size(hub.size)}, incomplete: {hub.present} of {hub.parts} parts "
                        f"downloaded (colichat --model {hub.spec} downloads the rest)")
            continue
        name = hub.spec if hub else path
        size = hub.size if hub else _size(path)
        rows.append(displayable(f"{name}{mark}: {about(name, path, size)}"))
    return rows


def about(name: str, path: str, size: int) -> str:
    """'llama, 9.0 MiB, runs (36 MiB of weights as f32)', or why it does not run here."""
    try:
        heads = file_headers(path)
    except (OSError, HeaderError, struct.error, ModelError):
        return f"{format_size(size)}, does not run: not a GGUF file colichat can read (damaged, or a part missing)"
    arch = heads[0].kv.get("general.architecture")
    try:
        check_headers(name, heads)
    except ModelError as e:
        return f"{arch}, {format_size(size)}, does not run: {str(e).removeprefix(name + ': ')}"
    need = dense_bytes((t.name, t.shape) for h in heads for t in h.tensors)
    return f"{arch}, {format_size(size)}, runs ({format_size(need)} of weights as f32)"


def _size(path: str) -> int:
    """Bytes of the GGUF `path`, with the other parts of a split model beside it."""
    m = SPLIT_RE.match(os.path.basename(path))
    if m is None:
        return os.path.getsize(path)
    d = os.path.dirname(path)
    parts = (os.path.join(d, f"{m['stem']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, int(m["n"]) + 1))
    return sum(os.path.getsize(p) for p in parts if os.path.isfile(p))
