"""The engine: token ids -> logits. Knows nothing about session files or text turns.

    model = load("model.gguf")          # Model with .prefill(ids), .decode(id), .cache, .tokenizer
    tok = load_tokenizer("model.gguf")  # works on vocabulary-only files too
"""

from __future__ import annotations

from .gguf import ModelConfig, ModelError, Tensors, load_config, open_gguf
from .model import Model
from .sampler import Sampler, SamplerSettings

DEFAULT_CTX = 8192

__all__ = ["Model", "ModelConfig", "ModelError", "Sampler", "SamplerSettings", "load", "load_tokenizer"]


def load_tokenizer(path_or_reader):
    from .tokenizer import load_tokenizer as _load

    return _load(path_or_reader)


def load(path: str, n_ctx: int | None = None, progress=None) -> Model:
    """Open a GGUF, check it, dequantize its weights, and return a Model with an empty cache.

    n_ctx: the cache size in tokens (default: the training context, at most DEFAULT_CTX).
    progress: optional callback(done, total) while weights are prepared.
    """
    from .model import prepare_weights
    from .tokenizer import load_tokenizer as _load_tokenizer

    path = str(path)
    reader = open_gguf(path)
    tensors = Tensors(reader, path)
    cfg = load_config(reader, path, tensors)
    tokenizer = _load_tokenizer(reader)
    if n_ctx is None:
        n_ctx = min(cfg.n_ctx_train, DEFAULT_CTX)
    if n_ctx < 16:
        raise ModelError(f"context size {n_ctx} is too small (at least 16 tokens)")
    weights = prepare_weights(cfg, tensors, progress)
    return Model(cfg, weights, tokenizer, n_ctx, tensors)
