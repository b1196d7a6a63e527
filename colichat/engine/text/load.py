"""Which tokenizer a GGUF holds: its `tokenizer.*` and `general.*` keys (read from the header alone,
fast), and the tokenizer `tokenizer.ggml.model` names: byte-level BPE (tokenizer.py) or
SentencePiece (spm.py, a subclass of it).
"""

from __future__ import annotations

import mmap
import os
import struct

from ...errors import ModelError
from ..gguf.header import HeaderError, read_header
from ..gguf.tensors import field, open_gguf
from .spm import SentencePieceTokenizer
from .tokenizer import Tokenizer


def _read_metadata(path: str) -> dict:
    """The `tokenizer.*` and `general.*` keys of a GGUF file, read by gguf/header.py (~25 ms for
    SmolLM2, where gguf-py takes seconds). Anything unexpected raises, and the caller falls back
    to gguf-py."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file
            raise HeaderError("an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return read_header(buf, lambda key: key.startswith(("tokenizer.", "general.")), tensors=False).kv


def _metadata(path_or_reader) -> tuple[dict, str]:
    if hasattr(path_or_reader, "fields"):
        reader = path_or_reader
        keys = [k for k in reader.fields if k.startswith(("tokenizer.", "general."))]
        return {k: field(reader, k) for k in keys}, str(getattr(reader, "path", "model"))
    path = os.fspath(path_or_reader)
    try:
        return _read_metadata(path), path
    except (OSError, HeaderError, struct.error):  # missing, cut short, not a GGUF the walker reads
        reader = open_gguf(path)  # raises a one-line ModelError for missing/damaged files
        return _metadata(reader)[0], path


def tokenizer_from_metadata(meta: dict, where: str = "model") -> Tokenizer:
    """The tokenizer the GGUF keys `meta` describe, by `tokenizer.ggml.model`: byte-level BPE
    ("gpt2") or SentencePiece ("llama")."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelError(f"{where}: no tokenizer in this GGUF (missing 'tokenizer.ggml.model')")
    if model == "gpt2":
        return Tokenizer(meta, where)
    if model == "llama":
        return SentencePieceTokenizer(meta, where)
    raise ModelError(f"{where}: tokenizer model '{model}' is not supported; colichat reads byte-level "
                     "BPE ('gpt2') and SentencePiece ('llama') vocabularies")


def load_tokenizer(path_or_reader) -> Tokenizer:
    """The tokenizer of a GGUF file: a path (metadata read directly, fast) or an open GGUFReader."""
    meta, where = _metadata(path_or_reader)
    return tokenizer_from_metadata(meta, where)
