"""The engine: token ids -> logits. Knows nothing about session files or text turns.

    model = load("model.gguf")          # Model with .prefill(ids), .decode(id), .cache, .tokenizer
    tok = load_tokenizer("model.gguf")  # works on vocabulary-only files too
    resume_problem("model.gguf", n_ctx, rope_factors)  # before loading: can a saved conversation go on
    trained_context("model.gguf")       # before loading: the most context load() gives (None: not said)
    default_context(n_ctx_train)        # the context load() gives without n_ctx
    check_headers(path, file_headers("model.gguf"))  # from headers alone (a download's too): runs and fits?

The layout: docs/design.md lists every module (gguf/ files in and out, text/ tokens and templates,
architectures/ one module per architecture, the shared Model in model.py).

Axis letters, the same in every engine module's shape comments (`# (T, H, R)`):
  T new tokens of a forward   N cache rows (tokens 0..N-1, new ones included)   P RoPE positions
  L layers   D model width (n_embd)   V vocabulary   F FFN hidden width   A, B cache widths (cache.py)
  H query heads   G KV heads (GQA)   J = H / G query heads per KV head   E head size (GQA)
  I rotated pairs (RoPE dims / 2)
  MLA: Q q_lora_rank, C kv_lora_rank, R qk_rope, Dn qk_nope, K = Dn + R (query head), Dv v head
  MoE: X routed experts, U experts used per token, Y expert groups, M tokens routed to one expert
  a matmul x (T, Z) @ W.T (Z, O): Z the summed axis, O the outputs
"""

from __future__ import annotations

from ..errors import ContextError, ModelError
from .architectures import architecture, check_architecture, load_config
from .cache import record_bytes
from .config import MIN_CTX, ModelConfig
from .gguf.tensors import Tensors, file_headers, open_gguf, trained_context
from .model import Model, available_memory, has_mtp, prepare_weights, rope_factors_problem
from .mtp import bytes_per_token as mtp_bytes_per_token
from .sampler import Sampler, SamplerSettings

DEFAULT_CTX = 8192

__all__ = ["ContextError", "Model", "ModelConfig", "ModelError", "Sampler", "SamplerSettings", "check_headers",
           "default_context", "f32_bytes_but_experts", "file_headers", "load", "load_tokenizer", "resume_problem",
           "trained_context"]


def load_tokenizer(path_or_reader):
    from .text.load import load_tokenizer as _load

    return _load(path_or_reader)


def load(path: str, n_ctx: int | None = None, progress=None, cache_dir=None, expert_cache: float | None = None,
         on_note=None, numerics: str = "fast", mtp: bool = True, check=None) -> Model:
    """Open a GGUF, check it, dequantize its weights, and return a Model with an empty cache.

    n_ctx: the cache size in tokens (default: the training context, at most DEFAULT_CTX).
    progress: optional callback(done, total) while weights are prepared.
    cache_dir: where dequantized weights are kept between runs (gguf/prepared.py); None: not kept.
    expert_cache: MiB of dequantized routed experts kept (MoE models; default: model.auto_expert_cache_mib).
    on_note: optional callback(line) for things worth telling the user (e.g. a cache not written).
    numerics: "fast", or "llama.cpp" to reproduce llama.cpp's CPU arithmetic bit for bit (slow).
    mtp: keep the draft state of the file's MTP block, if it has one (its rows count in the context's
    memory); False leaves it out. Decided at load, for the model's life (Model.mtp, Model.mtp_left_out).
    check: optional callback(cfg, tokenizer, n_ctx) run before the weights are prepared (which can take
    minutes): what the caller will ask of them (its system prompt), refused now (ModelError).
    """
    from .gguf.prepared import entry_of, load_prepared, read_usage, save_prepared
    from .text.load import load_tokenizer as _load_tokenizer
    from .text.load import tokenizer_from_metadata
    from .text.template import check_chat_template

    path = str(path)
    prepared = load_prepared(path, cache_dir, on_note) if cache_dir is not None else None
    if prepared is not None:
        cfg, tensors, weights = prepared.config, prepared.tensors, prepared.weights
        tokenizer = tokenizer_from_metadata(prepared.tokenizer_meta, path)
    else:
        reader = open_gguf(path)
        tensors = Tensors(reader, path)
        cfg = load_config(reader, path, tensors)
        tokenizer = _load_tokenizer(reader)
        weights = None
    check_chat_template(tokenizer, path)  # a broken one is the file's fault: refused before any work
    n_ctx = context_size(cfg, n_ctx)
    if n_ctx < MIN_CTX:
        raise ContextError(f"context size {n_ctx} is too small (at least {MIN_CTX} tokens)")
    dense = dense_f32_bytes(tensors)
    check_memory(path, dense)
    a, b = architecture(cfg).cache_widths(cfg)
    record = record_bytes(cfg.n_layer, a, b, cfg.index_head_dim, cfg.n_index_layers)  # Model's KVCache record
    if mtp and has_mtp(cfg, numerics):
        record += mtp_bytes_per_token(cfg)  # what Model.mtp keeps per token
    check_context(n_ctx, cfg.n_ctx_train, record, dense)
    if check is not None:
        check(cfg, tokenizer, n_ctx)
    if weights is None:
        weights = prepare_weights(cfg, tensors, progress)
        if cache_dir is not None:
            problem = save_prepared(path, cache_dir, cfg, tokenizer.meta, weights, tensors)
            if on_note:
                size = sum(a.nbytes for a in weights.values()) >> 20
                on_note(problem or f"kept the dequantized weights ({size:,} MiB) in {cache_dir}; "
                        "later starts map them instead of dequantizing")
    model = Model(cfg, weights, tokenizer, n_ctx, tensors, expert_cache=expert_cache, numerics=numerics, mtp=mtp)
    if cache_dir is not None and model.experts is not None:
        model.usage_entry = entry_of(path, cache_dir)
        counts = read_usage(model.usage_entry, on_note) if model.usage_entry is not None else None
        if counts is not None:
            model.experts.warm(counts)  # (in the background: the model is usable now)
    return model


def context_size(cfg: ModelConfig, n_ctx: int | None) -> int:
    """The cache size load() gives: n_ctx, by default the training context, at most DEFAULT_CTX."""
    return default_context(cfg.n_ctx_train) if n_ctx is None else n_ctx


def default_context(n_ctx_train: int) -> int:
    """The cache size load() gives a model trained for `n_ctx_train` tokens when no n_ctx is asked for."""
    return min(n_ctx_train, DEFAULT_CTX)


def resume_problem(path: str, n_ctx: int | None, rope_factors: str | None) -> str | None:
    """Before loading (the GGUF's metadata only): why a conversation whose cache rows were rotated
    with `rope_factors` cannot go on with this model at load(path, n_ctx)'s context size (one line),
    or None. A file that cannot be read is the ModelError loading it would raise."""
    if rope_factors is None:
        return None
    reader = open_gguf(str(path))
    cfg = load_config(reader, str(path), Tensors(reader, str(path)))
    return rope_factors_problem(cfg, context_size(cfg, n_ctx), rope_factors)


def dense_f32_bytes(tensors: Tensors) -> int:
    """What dequantizing every tensor but the routed experts (which stay quantized) takes as f32."""
    return f32_bytes_but_experts((name, tensors.shape(name)) for name in tensors.by_name)


def f32_bytes_but_experts(shapes) -> int:
    """dense_f32_bytes of (name, shape) pairs (a loaded model's, or a GGUF header's tensor infos)."""
    total = 0
    for name, shape in shapes:
        if "_exps." not in name:
            n = 1
            for d in shape:
                n *= d
            total += 4 * n
    return total


def check_headers(path: str, headers: list) -> None:
    """Refuse from a GGUF's headers alone (gguf.header.Header of every part of a split model, the first
    holding the metadata), before anything is downloaded or loaded, what load() refuses before any work:
    an architecture colichat does not run, dense weights that would not fit in memory as f32."""
    check_architecture(path, headers[0].kv.get("general.architecture"))
    check_memory(path, f32_bytes_but_experts((t.name, t.shape) for h in headers for t in h.tensors))


def check_context(n_ctx: int, n_ctx_train: int, record_bytes: int, weight_bytes: int) -> None:
    """Refuse a context longer than the model was trained for, or whose KV cache (record_bytes per
    token) cannot fit in the memory available beside the weights."""
    if n_ctx > n_ctx_train:
        raise ContextError(f"context size {n_ctx:,} is above the {n_ctx_train:,} tokens this model was "
                         f"trained for; use at most {n_ctx_train:,}")
    have = available_memory()
    need = record_bytes * n_ctx
    if have is not None and need + weight_bytes > have:
        fits = max(0, (have - weight_bytes) // record_bytes)
        raise ContextError(f"context size {n_ctx:,} needs {_size(need)} for its KV cache, but only "
                         f"{_size(have)} of memory is available and the weights take "
                         f"{_size(weight_bytes)}; use at most {fits:,} tokens")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_memory(path: str, need: int) -> None:
    """Refuse, before dequantizing, a model whose f32 weights cannot fit in the memory available."""
    have = available_memory()
    if have is not None and need > have:
        raise ModelError(f"{path}: its weights need {need / 2**30:.1f} GiB as f32 but only "
                         f"{have / 2**30:.1f} GiB of memory is available; use a smaller model")
