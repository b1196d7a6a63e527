"""The architectures colichat runs: GGUF general.architecture -> the module that runs it
(ARCHITECTURES), the ones it knows and does not run (KNOWN_UNSUPPORTED), and the one place GGUF
metadata becomes a ModelConfig (load_config). Nothing else asks `if arch == ...`.

An architecture module (llama.py, deepseek2.py; dsa.py, plm.py and minicpm3.py derive from deepseek2) holds:

    CACHE_KIND = "mla" | "gqa"              # the KVCache kind (and session file format) of its rows
    config(key, common, tensors) -> ModelConfig
        # key(name, default=None, required=False) reads "{arch}.{name}" metadata; common holds the
        # fields every architecture has (load_config); arch-specific fields are optional
        # fields of the one frozen ModelConfig
    cache_widths(cfg) -> (A, B)             # floats per token per layer in the cache
    prepare(cfg, tensors, progress=None) -> dict[str, np.ndarray]
        # dense f32 weights by GGUF-derived names (routed experts stay lazy)
    class Forward:                          # built once per Model: rope tables, kq_scale, routing, experts
        __init__(cfg, weights, tensors, n_ctx, expert_cache_mib)
        experts                             # its ExpertCache, or None
        layer(l, x, pos0, cache) -> x       # (T, D) -> (T, D); writes cache rows pos0..pos0+T-1
        logits(x) -> (T, V)
        exact_passes = True                 # optional: a pass of 2..ops.SMALL_BATCH tokens gives decode's
                                            # rows bit for bit (drafts can be checked; an MTP block drafts)
        # optional, where the rope depends on the context size (minicpm3's LongRoPE):
        rope_factors, default_rope_factors  # the factor set in use, and the one n_ctx picks
        use_rope_factors(name)              # rotate with another set (a resumed conversation's)
    rope_factors_problem(cfg, n_ctx, name) -> str | None   # why that set cannot serve n_ctx

and reference/<same name>.py holds a Forward with the same interface in llama.cpp's arithmetic
(numerics="llama.cpp"; see forward_class). Adding an architecture is one module plus one line in
ARCHITECTURES; one derived from deepseek2 imports its pieces (config_fields, prepare_layer,
mla_rope, routing, or subclasses Forward) instead of copying them. The shared Model: ../model.py.

Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import importlib
import os

from ...errors import ModelError
from ..config import MIN_CTX, ModelConfig
from ..gguf.tensors import Tensors, field, scalar
from . import deepseek2, dsa, llama, minicpm3, plm

# GGUF general.architecture -> the module that runs it.
ARCHITECTURES = {
    "llama": llama,
    "deepseek2": deepseek2,
    "plm": plm,
    "minicpm3": minicpm3,
    "deepseek32": dsa,
    "glm-dsa": dsa,
}

# Architectures that exist in GGUF files but that colichat does not run (yet); named in the refusal.
KNOWN_UNSUPPORTED = {
    "deepseek2-ocr": "vision encoder (not implemented)",
    "deepseek4": "DeepSeek-V4: compressed attention with its own indexer, hyper-connections (not implemented)",
    "glm5-next": "GLM-5.3-Flash: hybrid linear attention (KDA) + MLA with a k-pool indexer (not implemented)",
    "kimi-k3": "hybrid linear attention (KDA) + MLA (not implemented)",
    "kimi-linear": "hybrid linear attention (KDA) + MLA (not implemented)",
}


def architecture(cfg: ModelConfig):
    """The module that runs cfg's architecture."""
    mod = ARCHITECTURES.get(cfg.arch)
    if mod is None:
        raise ModelError(f"{cfg.path}: architecture '{cfg.arch}' has no forward pass yet")
    return mod


def forward_class(mod, numerics: str):
    """The one place numerics are chosen: "fast" (float32 math, BLAS) is the module's Forward;
    "llama.cpp" (llama.cpp's CPU arithmetic reproduced op by op; slow, for checking against
    llama.cpp) is the Forward of reference/<module name>.py, imported on demand."""
    if numerics == "fast":
        return mod.Forward
    if numerics != "llama.cpp":
        raise ValueError(f"numerics must be 'fast' or 'llama.cpp', not {numerics!r}")
    name = f"{__package__}.reference.{mod.__name__.rsplit('.', 1)[-1]}"
    try:
        return importlib.import_module(name).Forward
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ModelError(f"llama.cpp numerics do not cover {mod.__name__.rsplit('.', 1)[-1]} models; "
                         "use the default numerics") from None


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


def check_architecture(path: str, arch) -> None:
    """Refuse (ModelError) an architecture colichat does not run, naming those it runs."""
    if arch in KNOWN_UNSUPPORTED:
        raise ModelError(
            f"{path}: architecture '{arch}' is not supported ({KNOWN_UNSUPPORTED[arch]}); "
            f"colichat runs: {', '.join(ARCHITECTURES)}"
        )
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"{path}: architecture '{arch}' is not supported; colichat runs: {', '.join(ARCHITECTURES)}"
        )


def load_config(reader, path: str, tensors: Tensors) -> ModelConfig:
    """The one place metadata becomes a config: the keys every architecture has, read here, then
    the architecture module's config() (ARCHITECTURES). Defaults are llama.cpp's (docs:
    mla-spec section 1)."""
    arch = field(reader, "general.architecture", required=True)
    check_architecture(path, arch)

    def key(k, default=None, required=False, raw=False):  # raw: an array key as stored (not collapsed)
        v = field(reader, f"{arch}.{k}", default, required)
        return v if raw else scalar(v)

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
