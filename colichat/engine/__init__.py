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

import numpy as np

from ..errors import ContextError, ModelError
from ..units import format_size
from .architectures import architecture, check_architecture, load_config
from .cache import record_bytes
from .config import MIN_CTX, ModelConfig
from .gguf.tensors import Tensors, file_headers, open_gguf, trained_context
from .model import Model, available_memory, has_mtp, prepare_weights, rope_factors_problem, working_bytes
from .mtp import bytes_per_token as mtp_bytes_per_token
from .sampler import Sampler, SamplerSettings

DEFAULT_CTX = 8192
# weights under this as f32 run on the numpy path under --kernels auto where a matrix type has no int8 products
# (kernel_path): BLAS multiplies small f32 matrices faster than those kernels' float32 sums
SMALL_F32 = 1 << 30

__all__ = ["ContextError", "Model", "ModelConfig", "ModelError", "Sampler", "SamplerSettings", "check_headers",
           "default_context", "f32_bytes_but_experts", "file_headers", "kernel_path", "kernels_kept", "load",
           "load_tokenizer", "prepare_kernels", "resume_problem", "runs_kernels",
           "trained_context"]


def load_tokenizer(path_or_reader):
    from .text.load import load_tokenizer as _load

    return _load(path_or_reader)


def load(path: str, n_ctx: int | None = None, progress=None, cache_dir=None, expert_cache: float | None = None,
         on_note=None, numerics: str = "fast", mtp: bool = True, check=None, kernels: str = "numba") -> Model:
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
    kernels: "numba" keeps the large matrices as the GGUF holds them, multiplied by the compiled kernels
    (gguf/kernels.py, gguf/qmatrix.py); "numpy" dequantizes every weight to f32 (the reference path, taken
    also where the kernels cannot run, on_note told why, and for llama.cpp numerics). Model.kernels says
    which it is.
    """
    from .gguf.prepared import entry_of, load_prepared, read_usage, save_prepared
    from .text.load import load_tokenizer as _load_tokenizer
    from .text.load import tokenizer_from_metadata
    from .text.template import check_chat_template

    path = str(path)
    kernels = kernel_path(kernels, numerics, on_note, path)
    prepared = load_prepared(path, cache_dir, on_note, kernels) if cache_dir is not None else None
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
    dense = dense_f32_bytes(tensors, kernels) + working_bytes(cfg)  # what must fit (a mapped file need not)
    check_memory(path, dense)
    a, b = architecture(cfg).cache_widths(cfg)
    record = record_bytes(cfg.n_layer, a, b, cfg.index_head_dim, cfg.n_index_layers)  # Model's KVCache record
    if mtp and has_mtp(cfg, numerics):
        record += mtp_bytes_per_token(cfg)  # what Model.mtp keeps per token
    check_context(n_ctx, cfg.n_ctx_train, record, dense)
    if check is not None:
        check(cfg, tokenizer, n_ctx)
    tensors.kernels = kernels == "numba"
    if weights is None:
        weights = prepare_weights(cfg, tensors, progress)
        if cache_dir is not None:
            problem = save_prepared(path, cache_dir, cfg, tokenizer.meta, weights, tensors, kernels)
            if on_note:
                size = sum(a.nbytes for a in weights.values() if isinstance(a, np.ndarray))
                if len(weights) > sum(isinstance(a, np.ndarray) for a in weights.values()):  # QMatrix: not kept
                    kept = f"kept the weights read as f32 ({format_size(size)}) in {cache_dir}; later starts map them"
                else:
                    kept = (f"kept the dequantized weights ({size >> 20:,} MiB) in {cache_dir}; "
                            "later starts map them instead of dequantizing")
                on_note(problem or kept)
    model = Model(cfg, weights, tokenizer, n_ctx, tensors, expert_cache=expert_cache, numerics=numerics, mtp=mtp,
                  kernels=kernels)
    if kernels == "numba":  # (the numpy path reads only routed experts from the map, with preadv)
        model.page_in()
    if cache_dir is not None and model.experts is not None:
        model.usage_entry = entry_of(path, cache_dir, kernels)
        counts = read_usage(model.usage_entry, on_note) if model.usage_entry is not None else None
        if counts is not None:
            model.experts.warm(counts)  # (in the background: the model is usable now)
    return model


def prepare_kernels(path: str, cache_dir, on_compile=None) -> float | None:
    """Compile the kernels of the types GGUF `path` holds, or load them from numba's cache under
    cache_dir/kernels (kernels.prepare): the seconds it took, or None where there is nothing to prepare (the
    file holds no type the kernels take) or they cannot run (load() then takes the numpy path and says
    why). on_compile() is called first when that cache does not hold them yet (a first start: seconds,
    worth saying)."""
    from .gguf import kernels as compiled

    names = kernel_types(path)
    if not names or compiled.problem() is not None:
        return None
    if on_compile is not None and not compiled.cached(str(cache_dir), names):
        on_compile()
    return compiled.prepare(str(cache_dir), names=names)


def runs_kernels(path: str, kernels: str, numerics: str) -> bool:
    """Whether load(path, kernels=..., numerics=...) runs the compiled kernels (so that prepare_kernels should
    ready them first): the kernel path, or llama.cpp numerics on a file with weights those multiply with the
    kernels' products (the K-quants and IQ4: architectures/reference/ggml_ops.INT8_KINDS)."""
    from .architectures.reference.ggml_ops import INT8_KINDS

    if numerics == "llama.cpp":
        return bool(set(kernel_types(path)) & set(INT8_KINDS))
    return kernel_path(kernels, numerics, path=path) == "numba"


def kernels_kept(cache_dir) -> bool:
    """Whether the compiled kernels can be kept between starts, in numba's cache under cache_dir/kernels
    (not where that cannot be written: every start then compiles them)."""
    from .gguf import kernels as compiled

    return compiled.cache_path(str(cache_dir)) is not None


def kernel_types(path: str) -> list[str]:
    """The types of GGUF `path`'s tensors that the kernels take (not F32, which BLAS multiplies), from its
    header alone (milliseconds): where there is none, the kernel path needs neither numba nor a compile."""
    import struct

    import gguf

    from .gguf import kernels as compiled
    from .gguf.header import HeaderError

    names = {int(q): q.name for q in gguf.GGMLQuantizationType}
    try:
        types = {names.get(t.ggml_type) for h in file_headers(path) for t in h.tensors}
    except (OSError, HeaderError, struct.error, ModelError):  # (loading says what is wrong with the file)
        return []
    return sorted(q for q in types if q is not None and q != "F32" and compiled.supported(q))


def small_as_f32(path: str) -> bool:
    """Whether GGUF `path`'s weights but its routed experts take under SMALL_F32 as f32 (its header alone)."""
    import struct

    from .gguf.header import HeaderError

    try:
        shapes = [(t.name, t.shape) for h in file_headers(path) for t in h.tensors]
    except (OSError, HeaderError, struct.error, ModelError):  # (loading says what is wrong with the file)
        return False
    return f32_bytes_but_experts(shapes) < SMALL_F32


def kernel_path(kernels: str, numerics: str, on_note=None, path: str | None = None) -> str:
    """The path load() takes: "numba" where asked for and the kernels run here (else "numpy", on_note
    told why in one line; not asked of numba for a GGUF `path` with no type they take), "numpy" for
    llama.cpp numerics (their reference works on f32 weights). "auto" is "numba" but for a `path` small as f32
    (small_as_f32) whose matrices are not all of types with int8 products (kernels.INT8_ACTIVATIONS): numpy's
    BLAS multiplies small f32 matrices faster than the float32 sums of the other types' kernels (SmolLM2's
    Q4_1 decodes 1.7x faster on the kernels, BENCHMARKS.md)."""
    from .gguf import kernels as compiled

    if kernels not in ("auto", "numba", "numpy"):
        raise ValueError(f"kernels must be 'auto', 'numba' or 'numpy', not {kernels!r}")
    if kernels == "numpy" or numerics != "fast":
        return "numpy"
    types = kernel_types(path) if path is not None else None  # (from the file's header: read once)
    if kernels == "auto" and path is not None and small_as_f32(path) and not set(types or ["F32"]) <= set(
            compiled.INT8_ACTIVATIONS):
        return "numpy"
    problem = compiled.problem() if path is None or types else None
    if problem is not None:
        if on_note:
            on_note(f"compiled kernels cannot run here ({problem}): weights dequantized to f32 (--kernels numpy)")
        return "numpy"
    return "numba"


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


# matrices the kernel path keeps as f32: MLA's k_b/v_b (absorbed into the attention), routers, the indexer's
KEPT_F32 = ("attn_k_b.", "attn_v_b.", "attn_kv_b.", "ffn_gate_inp.", ".indexer.")


def dense_f32_bytes(tensors: Tensors, kernels: str = "numba") -> int:
    """What the weights but the routed experts take in memory as f32 on the kernel path `kernels`."""
    return held_f32_bytes(((n, tensors.shape(n), tensors.qtype(n).name) for n in tensors.by_name), kernels)


def held_f32_bytes(infos, kernels: str) -> int:
    """dense_f32_bytes of (name, shape, type name) triples (a loaded model's, or a GGUF header's): on the
    numpy path every tensor but the routed experts (f32_bytes_but_experts); on the kernel path only what
    stays f32: norms, biases, KEPT_F32, tensors the file keeps in F32 and types the kernels do not take
    (the other matrices are read from the map, and need not all fit in memory)."""
    from .gguf import kernels as compiled

    infos = list(infos)
    if kernels == "numba":
        infos = [(n, s, q) for n, s, q in infos
                 if len(s) < 2 or q == "F32" or not compiled.supported(q) or any(k in n for k in KEPT_F32)]
    return f32_bytes_but_experts((n, s) for n, s, _ in infos)


def f32_bytes_but_experts(shapes) -> int:
    """What (name, shape) pairs take as f32, the routed experts (which stay quantized) left out."""
    total = 0
    for name, shape in shapes:
        if "_exps." not in name:
            n = 1
            for d in shape:
                n *= d
            total += 4 * n
    return total


def check_headers(path: str, headers: list, kernels: str = "numba") -> None:
    """Refuse from a GGUF's headers alone (gguf.header.Header of every part of a split model, the first
    holding the metadata), before anything is downloaded or loaded, what load() refuses before any work:
    an architecture colichat does not run, weights that would not fit in memory as f32 on the path
    load(kernels=...) would take (a mapped file need not fit)."""
    import gguf

    check_architecture(path, headers[0].kv.get("general.architecture"))
    names = {int(q): q.name for q in gguf.GGMLQuantizationType}  # (a type it does not know: counted as f32)
    infos = [(t.name, t.shape, names.get(t.ggml_type, "?")) for h in headers for t in h.tensors]
    from .gguf import kernels as compiled

    if any(q != "F32" and compiled.supported(q) for _, _, q in infos):  # (else numba need not be asked)
        kernels = kernel_path(kernels, "fast")
    check_memory(path, held_f32_bytes(infos, kernels))


def check_context(n_ctx: int, n_ctx_train: int, record_bytes: int, weight_bytes: int) -> None:
    """Refuse a context longer than the model was trained for, or whose KV cache (record_bytes per
    token) cannot fit in the memory available beside the weights and buffers (weight_bytes: what of
    them must fit, a mapped file not)."""
    if n_ctx > n_ctx_train:
        raise ContextError(f"context size {n_ctx:,} is above the {n_ctx_train:,} tokens this model was "
                         f"trained for; use at most {n_ctx_train:,}")
    have = available_memory()
    need = record_bytes * n_ctx
    if have is not None and need + weight_bytes > have:
        fits = max(0, (have - weight_bytes) // record_bytes)
        raise ContextError(f"context size {n_ctx:,} needs {_size(need)} for its KV cache, but only "
                         f"{_size(have)} of memory is available and the weights and buffers take "
                         f"{_size(weight_bytes)}; use at most {fits:,} tokens")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_memory(path: str, need: int) -> None:
    """Refuse, before preparing them, weights whose f32 part (`need`: all of them on the numpy path) cannot
    fit in the memory available."""
    have = available_memory()
    if have is not None and need > have:
        raise ModelError(f"{path}: its weights need {need / 2**30:.1f} GiB as f32 but only "
                         f"{have / 2**30:.1f} GiB of memory is available; use a smaller model")
