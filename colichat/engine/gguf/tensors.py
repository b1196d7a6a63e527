"""Open a GGUF file: metadata -> one frozen ModelConfig, tensors by GGUF name, dequantized on request.

Shapes: gguf-py reports `ReaderTensor.shape` in ggml order (ne); we only ever use numpy shapes,
which are `reversed(ne)`: a linear layer `[in, out]` in GGUF is `(out, in)` here, and `y = W @ x`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import dequant
from .file import GGUFFile, Truncated
from .header import HeaderError, read_header

# Architectures that exist in GGUF files but that colichat does not run (yet); named in the refusal.
KNOWN_UNSUPPORTED = {
    "deepseek2-ocr": "vision encoder (not implemented)",
    "deepseek4": "DeepSeek-V4: compressed attention with its own indexer, hyper-connections (not implemented)",
    "glm5-next": "GLM-5.3-Flash: hybrid linear attention (KDA) + MLA with a k-pool indexer (not implemented)",
    "kimi-k3": "hybrid linear attention (KDA) + MLA (not implemented)",
    "kimi-linear": "hybrid linear attention (KDA) + MLA (not implemented)",
}


MIN_CTX = 16  # the smallest context a conversation has room in (a template's frame and a few words)


class ModelError(Exception):
    """A model file colichat cannot use. The message is one line meant for the user."""


class ContextError(ModelError):
    """A context size the model cannot run with: too small, longer than it was trained for, more than
    memory holds, or without room for the system prompt and a message."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs, read once from GGUF metadata (and tensor presence)."""

    path: str
    arch: str
    name: str
    n_layer: int          # L
    n_embd: int           # D
    n_head: int           # H
    n_head_kv: int        # G: GQA KV heads (llama); informational for MLA
    n_ff: int             # F: dense FFN width
    n_vocab: int          # V
    n_ctx_train: int
    rms_eps: float
    # attention head sizes
    head_dim: int         # E: llama q/k/v head size
    rope_dim: int         # n_rot = 2I (deepseek2: R)
    rope_base: float
    rope_scaling: str     # "none" | "linear" | "yarn"
    rope_factor: float    # scaling factor (1.0 = none)
    rope_orig_ctx: int    # YaRN original context
    yarn_log_mul: float   # deepseek2: 0.1 * mscale_all_dim, as stored
    rope_attn_factor: float
    tied_output: bool     # no output.weight: logits use token_embd
    # MLA (deepseek2); zero for llama
    q_lora_rank: int = 0      # Q (0: attn_q, "lite")
    kv_lora_rank: int = 0     # C
    qk_nope: int = 0          # Dn
    qk_head: int = 0          # K = Dn + R
    v_head_dim: int = 0       # Dv
    mla_split: bool = False   # attn_k_b/attn_v_b present (else legacy attn_kv_b)
    n_dense: int = 0          # leading dense layers
    n_expert: int = 0         # X
    n_expert_used: int = 0    # U
    n_expert_shared: int = 0  # shared experts
    n_ff_exp: int = 0         # F of one routed expert
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating: int = 1    # 1 softmax, 2 sigmoid
    n_group: int = 0          # Y
    n_group_used: int = 0
    attn_temp_scale: float = 0.0  # Mistral-Large-3 query temperature tuning (0 = off)
    attn_temp_length: int = 0
    n_nextn: int = 0          # MTP (NextN) blocks after the trunk: blk.{n_layer}.. (never in the cache)
    sampling: tuple = ()      # the model's own sampling defaults (general.sampling.*): ((setting, value), ...)
    # sparse-attention MLA (deepseek32, glm-dsa): the lightning indexer; zero without one
    index_n_head: int = 0     # Hi
    index_head_dim: int = 0   # Di
    index_top_k: int = 0      # K keys attended per query
    index_types: tuple = ()   # per layer: 1 full indexer (owns Ic rows), 0 shared (reuses a selection)
    index_neox: bool = False  # indexer rope pairing: NEOX (deepseek32) or NORM (glm-dsa)
    index_eps: float = 0.0    # LayerNorm eps of the indexer key

    def __post_init__(self):
        object.__setattr__(self, "index_types", tuple(int(v) for v in self.index_types))  # JSON gives a list

    @property
    def output_weight(self) -> str:
        """The weight the logits multiply by: "output", or "token_embd" when tied (no output.weight)."""
        return "token_embd" if self.tied_output else "output"

    @property
    def n_index_layers(self) -> int:
        """Layers that own a full indexer: the nic of the cache record (0 without DSA)."""
        return sum(self.index_types)


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
        n = _scalar(n) if isinstance(n, list) else n
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
        return GGUFFile(path)  # a well-formed file, read in one pass (gguf_file.py)
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


def _scalar(v):
    """Per-layer array keys (u32[L]) collapse to their first value; colichat needs uniform layers."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ModelError(f"per-layer varying hyper-parameters are not supported ({v[:4]}...)")
        return v[0]
    return v


class TensorRecord(NamedTuple):
    """One GGUF tensor as Tensors needs it (gguf-py's ReaderTensor has these fields too)."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple         # ggml order (ne)
    n_bytes: int
    data: np.ndarray     # the raw data, memory-mapped, numpy layout


class Tensors:
    """GGUF tensors by name; `f32(name)` dequantizes one tensor (or one expert) on request.

    `files[name]` and `offsets[name]` say where each tensor's data lies (its file may be one part
    of a split model), so a prepared model can map it again without parsing the GGUF.
    """

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

    @classmethod
    def from_records(cls, path: str, records: list[TensorRecord], files: dict, offsets: dict) -> Tensors:
        self = cls.__new__(cls)
        self._init(path, records, files, offsets)
        return self

    def _init(self, path: str, tensors: list, files: dict, offsets: dict) -> None:
        import gguf

        self.path = path
        self.files, self.offsets = files, offsets
        self.by_name = {t.name: t for t in tensors}
        supported = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
        supported |= set(getattr(gguf.quants, "_type_traits", {}))
        for t in tensors:
            if t.tensor_type not in supported:
                raise ModelError(
                    f"{path}: tensor {t.name} has quant type {t.tensor_type.name}, "
                    "which colichat cannot dequantize; use a file with another quant type"
                )

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

    def nbytes(self, name: str) -> int:
        return int(self.require(name).n_bytes)

    def check(self, name: str, shape: tuple) -> str:
        """Require tensor `name` with numpy shape `shape` (without reading it); returns the name."""
        got = self.shape(name)
        if got != tuple(shape):
            raise ModelError(f"{self.path}: tensor '{name}' has shape {got}, expected {tuple(shape)}")
        return name


# general.sampling.* keys (gguf-py's Keys.General.SAMPLING_*) -> colichat's settings of the same meaning
SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n"}


def sampling_defaults(reader) -> tuple:
    """The sampling defaults the model's makers put in the file (general.sampling.temp, ...), as
    ((setting, number), ...): values that are not numbers are left out (the settings check the rest)."""
    found = []
    for key, setting in SAMPLING_KEYS.items():
        v = field(reader, f"general.sampling.{key}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            found.append((setting, v))
    return tuple(found)


def load_config(reader, path: str, tensors: Tensors) -> ModelConfig:
    """The one place metadata becomes a config: the keys every architecture has, read here, then
    the architecture module's config() (model.ARCHITECTURES). Defaults are llama.cpp's (docs:
    mla-spec section 1)."""
    from ..model import ARCHITECTURES

    arch = field(reader, "general.architecture", required=True)
    if arch in KNOWN_UNSUPPORTED:
        raise ModelError(
            f"{path}: architecture '{arch}' is not supported ({KNOWN_UNSUPPORTED[arch]}); "
            f"colichat runs: {', '.join(ARCHITECTURES)}"
        )
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"{path}: architecture '{arch}' is not supported; colichat runs: {', '.join(ARCHITECTURES)}"
        )

    def key(k, default=None, required=False, raw=False):  # raw: an array key as stored (not collapsed)
        v = field(reader, f"{arch}.{k}", default, required)
        return v if raw else _scalar(v)

    n_embd = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    if n_head <= 0 or n_embd <= 0:
        raise ModelError(f"{path}: damaged GGUF file: {arch}.attention.head_count {n_head}, "
                         f"{arch}.embedding_length {n_embd}; download it again")
    n_head_kv = int(key("attention.head_count_kv", n_head))
    key_length = int(key("attention.key_length", n_embd // n_head))
    n_nextn = int(key("nextn_predict_layers", 0) or 0)
    n_layer = int(key("block_count", required=True)) - n_nextn
    if n_layer <= 0 or n_nextn < 0:
        raise ModelError(f"{path}: nextn_predict_layers {n_nextn} leaves no trunk layers")
    tokens = field(reader, "tokenizer.ggml.tokens")
    n_vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    if n_vocab == 0:
        n_vocab = tensors.shape("token_embd.weight")[0]
    rope_dim = int(key("rope.dimension_count", key_length))
    scaling = str(key("rope.scaling.type", "linear"))
    factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
    if factor <= 0.0 or scaling == "none":
        factor = 1.0
    if scaling not in ("none", "linear", "yarn"):
        raise ModelError(f"{path}: rope scaling '{scaling}' is not supported (none, linear, yarn)")
    n_ctx_train = int(key("context_length", required=True))
    if n_ctx_train < MIN_CTX:  # damaged metadata, not the user's --ctx
        raise ModelError(f"{path}: its metadata says {arch}.context_length is {n_ctx_train}; a model needs a "
                         f"context of at least {MIN_CTX} tokens: the file is damaged, or not a chat model")
    common = dict(
        path=path,
        arch=arch,
        name=str(field(reader, "general.name", os.path.basename(path))),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=int(key("feed_forward_length", 0)),
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        rms_eps=float(key("attention.layer_norm_rms_epsilon", required=True)),
        head_dim=key_length,
        rope_dim=rope_dim,
        rope_base=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_factor=factor,
        rope_orig_ctx=int(key("rope.scaling.original_context_length", n_ctx_train)),
        yarn_log_mul=float(key("rope.scaling.yarn_log_multiplier", 0.0)),
        rope_attn_factor=float(key("rope.scaling.attn_factor", 1.0)),
        tied_output=not tensors.has("output.weight"),
        n_nextn=n_nextn,
        sampling=sampling_defaults(reader),
    )
    if n_nextn and not all(tensors.has(f"blk.{n_layer + m}.nextn.eh_proj.weight") for m in range(n_nextn)):
        raise ModelError(f"{path}: nextn_predict_layers is {n_nextn} but 'blk.{n_layer}.nextn.eh_proj.weight' "
                         "is missing")
    if not n_nextn and any(".nextn." in n for n in tensors.by_name):
        raise ModelError(f"{path}: has MTP (nextn) tensors but no '{arch}.nextn_predict_layers' key")
    return ARCHITECTURES[arch].config(key, common, tensors)
