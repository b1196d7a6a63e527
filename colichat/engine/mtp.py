"""MTP (NextN) blocks: the draft head some deepseek2/deepseek32/glm-dsa files carry after the trunk.

docs/dsa-mtp-spec.md, "MTP (NextN) block". Block m is `blk.{n_layer + m}.`: its own attention and
FFN tensors (a full deepseek2 decoder block, dense attention, no indexer) plus `nextn.eh_proj`,
`nextn.enorm`, `nextn.hnorm` and optionally `nextn.embed_tokens`, `nextn.shared_head_norm`,
`nextn.shared_head_head`. The weights dict keeps them under their GGUF names without `.weight`
(`blk.3.nextn.eh_proj`, `blk.3.attn_in`, ...), like the trunk's.

MTP position q is fed (h_{q-1}, x_q): the trunk's hidden state of the previous position after
output_norm (zeros at q = 0) and the embedding of token q; its logits are the draft of token q+1.
The block attends over its own latent cache (one row per MTP position), which is never part of a
session file: after a load the draft state starts empty.

MTPDrafts is the draft source (speculative.DraftSource) built on block 0: Model.prefill hands it the
hidden states of every trunk forward (prompt, decode and verify passes alike), and a proposal first
feeds the block the positions it has not seen, then drafts one token. Its state (the block's rows,
the hidden states, the tokens they came from) is checked against the trunk's tokens at every use and
cut back where they differ, so rejected drafts, /rewind, /reset and a resumed conversation need no
call: after a resume (no hidden states for the rows read from the file) the block starts afresh at
the first position whose previous hidden state it has, its row 0 there (the rotary positions of
attention only matter relative to each other). Drafts never change the answer (Generation checks
them), so this state only decides how often they are kept.

Axis letters: T tokens, D model width, V vocabulary, N context.
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError
from .cache import KVCache, record_bytes
from .ops import linear, rms_norm
from .speculative import DraftSource

NEXTN_REQUIRED = ("eh_proj", "enorm", "hnorm")
NEXTN_OPTIONAL = ("embed_tokens", "shared_head_norm", "shared_head_head")
CHUNK = 512  # MTP positions per forward when catching up (bounds attention scratch, as prefill chunks)


def bytes_per_token(cfg) -> int:
    """Memory MTP drafting takes per context token: the block's cache record and the trunk hidden state."""
    return record_bytes(1, cfg.kv_lora_rank, cfg.rope_dim) + 4 * cfg.n_embd


def prepare_block(cfg, t, l: int, get, w: dict) -> None:
    """Check and keep the nextn.* tensors of MTP block layer l (its decoder tensors are prepared
    like a trunk layer's)."""
    b, d, v = f"blk.{l}.nextn.", cfg.n_embd, cfg.n_vocab
    shapes = {"eh_proj": (d, 2 * d), "enorm": (d,), "hnorm": (d,),
              "embed_tokens": (v, d), "shared_head_norm": (d,), "shared_head_head": (v, d)}
    for name in NEXTN_REQUIRED + NEXTN_OPTIONAL:
        if name in NEXTN_REQUIRED or t.has(b + name + ".weight"):
            w[b + name] = get(b + name + ".weight", shapes[name], len(shapes[name]) == 2)  # matrices: t.matrix's


class MTPBlock:
    """MTP block m of a loaded Model, with its own latent cache (n_ctx rows, never persisted)."""

    def __init__(self, model, m: int = 0):
        cfg = model.cfg
        if not 0 <= m < cfg.n_nextn:
            raise ValueError(f"{cfg.path} has {cfg.n_nextn} MTP blocks, not block {m}")
        if model.numerics != "fast":
            raise ModelError(f"{cfg.path}: the MTP block runs with the default numerics only")
        self.model, self.l = model, cfg.n_layer + m
        self.cache = KVCache("mla", 1, cfg.kv_lora_rank, cfg.rope_dim, model.n_ctx)

    def forward(self, h_prev: np.ndarray, tokens, pos0: int | None = None, last_only: bool = False) -> np.ndarray:
        """Draft logits (T, V) for MTP positions pos0..pos0+T-1 (default: after its cached rows);
        last_only: (1, V) for the last position only (the output head is most of a row's cost).

        h_prev: (T, D) the trunk's output_norm'd hidden states of positions pos0-1..pos0+T-2 (a
        zero row for position 0); tokens: (T,) the ids at positions pos0..pos0+T-1. Row i of the
        result is the draft of the token at position pos0+i+1. Writes the block's cache rows."""
        model, w, b = self.model, self.model.w, f"blk.{self.l}."
        cfg = model.cfg
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos0 = self.cache.length if pos0 is None else pos0
        if h_prev.shape != (ids.size, cfg.n_embd):
            raise ValueError(f"h_prev has shape {h_prev.shape}, expected ({ids.size}, {cfg.n_embd})")
        if not 0 <= pos0 <= self.cache.length or pos0 + ids.size > self.cache.capacity:
            raise ValueError(f"MTP position {pos0} with {ids.size} tokens does not follow its {self.cache.length} rows")
        e = w.get(b + "nextn.embed_tokens", w["token_embd"])[ids]  # (T, D)
        eh = np.concatenate([rms_norm(e, w[b + "nextn.enorm"], cfg.rms_eps),
                             rms_norm(h_prev.astype(np.float32), w[b + "nextn.hnorm"], cfg.rms_eps)], axis=1)
        u = linear(eh, w[b + "nextn.eh_proj"])  # (T, D)
        self.cache.tokens[pos0 : pos0 + ids.size] = ids
        u = model.fwd.layer(self.l, u, pos0, self.cache, slot=0)  # (T, D), dense attention (no indexer)
        self.cache.length = pos0 + ids.size
        if last_only:
            u = u[-1:]  # (1, D)
        hn = rms_norm(u, w.get(b + "nextn.shared_head_norm", w["output_norm"]), cfg.rms_eps)
        return linear(hn, w.get(b + "nextn.shared_head_head", model.output))  # (T, V)

    def truncate(self, n: int) -> None:
        """Drop rows past n (after a rejected draft, or a /rewind of the trunk)."""
        self.cache.truncate(max(0, min(n, self.cache.length)))

    def reset(self) -> None:
        self.cache.reset()


def step_cost(model, m: int = 0) -> float:
    """An MTP draft's cost in decode steps, from the weight bytes each reads per token (both passes
    are bound by memory bandwidth): block m's matrices and its output head against the trunk's
    layers and output matrix, routed experts counted as the ones a token uses."""
    cfg, w = model.cfg, model.w
    expert = 3 * cfg.n_ff_exp * cfg.n_embd * 4 * cfg.n_expert_used  # routed experts one token reads

    def layer_bytes(l: int) -> int:  # without the block's head (counted below) and embedding (one row read)
        b = f"blk.{l}."
        dense = sum(a.nbytes for k, a in w.items()
                    if k.startswith(b) and not k.endswith(("embed_tokens", "shared_head_head")))
        return dense + (expert if cfg.n_expert and l >= cfg.n_dense else 0)

    l = cfg.n_layer + m
    head = w.get(f"blk.{l}.nextn.shared_head_head", model.output).nbytes
    trunk = sum(layer_bytes(i) for i in range(cfg.n_layer)) + model.output.nbytes
    return (layer_bytes(l) + head) / trunk


class MTPDrafts(DraftSource):
    """One draft per step from MTP block 0, kept in step with the trunk (module docstring)."""

    name = "MTP"
    most = 1

    def __init__(self, model):
        cfg, n = model.cfg, model.n_ctx
        self.model, self.block = model, MTPBlock(model, 0)
        self.cost = step_cost(model)
        self.hidden = np.zeros((n, cfg.n_embd), dtype=np.float32)  # (N, D) trunk h by position (lazy pages)
        self.tokens = np.zeros(n, dtype=np.int32)  # (N,) the trunk tokens this state was computed from
        self.known = 0  # tokens[:known] are valid
        self.h_lo = self.h_hi = 0  # hidden[h_lo:h_hi] hold the trunk's hidden states (empty if equal)
        self.base = 0  # the trunk position of the block's row 0

    def observe(self, pos0: int, h: np.ndarray) -> None:
        """After a trunk forward of positions pos0..pos0+T-1 (their tokens are in the cache): h (T, D)
        their output_norm'd hidden states."""
        end = pos0 + h.shape[0]
        tokens = self.model.cache.tokens[:end]  # (pos0+T,)
        self._sync(tokens)
        self.tokens[:end] = tokens
        self.known = end
        self.hidden[pos0:end] = h
        if self.h_lo < self.h_hi and self.h_lo <= end and pos0 <= self.h_hi:  # overlapping or adjacent
            self.h_lo, self.h_hi = min(self.h_lo, pos0), max(self.h_hi, end)
        else:
            self.h_lo, self.h_hi = pos0, end

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        """The draft of the token after `history` (n+1,): the cached tokens and the one just chosen."""
        hist = np.asarray(history, dtype=np.int32)
        n = hist.size - 1
        if k < 1 or n < 1:
            return []
        self._sync(hist)
        blk, h = self.block, self.hidden
        blk.truncate(n - self.base)  # position n is fed now (again, if it was): its logits are the draft
        e = self.base + blk.cache.length  # the next trunk position the block is fed
        if blk.cache.length == 0 or not (self.h_lo <= e - 1 and n <= self.h_hi):
            if self.h_lo >= self.h_hi or self.h_hi < n:
                return []  # the trunk's last hidden state is not known (e.g. rows read from a file)
            blk.reset()  # start afresh where the hidden states begin
            self.base = e = 0 if self.h_lo == 0 else self.h_lo + 1
            if e > n:
                return []
        logits = None
        while e <= n:  # position q gets (h_{q-1}, token q); h_{-1} = 0
            stop = min(n + 1, e + CHUNK)
            h_prev = h[e - 1 : stop - 1] if e else np.concatenate([np.zeros_like(h[:1]), h[: stop - 1]])
            with self.model.threads.limit(stop - e, timed=False):  # not a decode step: not timed
                logits = blk.forward(h_prev, hist[e:stop], e - self.base, last_only=True)  # (1, V)
            e = stop
        self.tokens[: n + 1] = hist
        self.known = n + 1
        return [int(np.argmax(logits[0]))]

    def _sync(self, tokens: np.ndarray) -> None:
        """Forget what was computed from tokens other than `tokens` (the trunk's, from position 0)."""
        m = min(self.known, tokens.size)
        diff = np.flatnonzero(self.tokens[:m] != tokens[:m])
        keep = int(diff[0]) if diff.size else m  # positions < keep are still valid
        self.known = keep
        self.block.truncate(keep - self.base)
        self.h_hi = min(self.h_hi, keep)
        if self.h_hi <= self.h_lo:
            self.h_lo = self.h_hi = 0
