"""The model: token ids in, logits out, the cache grows. What every architecture shares lives here
(the cache, chunked prefill, decode, the memory checks, the MTP block's draft state); what differs
lives in one module per architecture, found through architectures.ARCHITECTURES (whose docstring
says what such a module holds).

Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import ModelError
from ..units import format_size
from .architectures import architecture, forward_class
from .cache import KVCache
from .cancel import Cancel
from .config import ModelConfig
from .ffn import ExpertCache
from .gguf.prepared import write_usage
from .gguf.qmatrix import QMatrix
from .gguf.tensors import Tensors
from .mapped_experts import MappedExperts
from .mtp import MTPDrafts
from .mtp import bytes_per_token as mtp_bytes_per_token
from .ops import SAFE_POINT, SMALL_BATCH, TILE_BYTES, rms_norm
from .threads import ThreadPolicy, cores

PREFILL_CHUNK = 512  # tokens per forward chunk: bounds the (H, T, N) score array of long prompts
DEFAULT_EXPERT_CACHE_MIB = 4096  # routed-expert cache bound where the available memory is unknown
EXPERT_CACHE_SHARE = 0.5  # of the memory left after the dense weights and the KV cache
EXPERT_CACHE_MIN_MIB = 512


def rope_factors_problem(cfg: ModelConfig, n_ctx: int, name: str | None) -> str | None:
    """Why a conversation whose cache rows were rotated with the rope factors `name` (None: the
    rope of every context size) cannot go on with this model at context size n_ctx (one line), or
    None when it can: the architecture module's rope_factors_problem, where its rope depends on the
    context size."""
    check = getattr(architecture(cfg), "rope_factors_problem", None)
    if check is not None:
        return check(cfg, n_ctx, name)
    if name is None:
        return None
    return (f"its cache rows were rotated with rope factors {str(name)[:40]!r}, but {cfg.arch} uses the "
            "same rope at every context size: start a new conversation")


def exact_passes(cfg: ModelConfig, numerics: str) -> bool:
    """Whether a Model of cfg computes a pass of 2..ops.SMALL_BATCH tokens as decoding them one by one
    would, bit for bit (its Forward's exact_passes; llama.cpp's numerics are not batched): then drafts
    can be checked in one pass (speculative decoding)."""
    return numerics == "fast" and bool(getattr(forward_class(architecture(cfg), numerics), "exact_passes", False))


def has_mtp(cfg: ModelConfig, numerics: str) -> bool:
    """Whether a Model of cfg can draft with an MTP block: the file has one and passes are exact."""
    return bool(cfg.n_nextn) and exact_passes(cfg, numerics)


def prepare_weights(cfg: ModelConfig, t: Tensors, progress=None) -> dict[str, np.ndarray]:
    """The dense weights of an architecture, dequantized (routed experts of MoE models stay lazy)."""
    return architecture(cfg).prepare(cfg, t, progress)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit() -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 memory.max, v1 memory.limit_in_bytes), None
    where it has none or it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue  # (not a cgroup line)
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            path = f"/sys/fs/cgroup{where}/memory.max"
        elif "memory" in controllers.split(","):
            path = f"/sys/fs/cgroup/memory{where}/memory.limit_in_bytes"
        else:
            continue
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 1 << 60:  # ("max", or v1's 2^63 - page: none)
            return int(value)
    return None


def auto_expert_cache_mib(available: int | None, committed: int, file_room: int | None = None) -> float | None:
    """The bound (MiB) of the routed-expert cache nobody set, the least of:

    - EXPERT_CACHE_SHARE of what MemAvailable (`available` bytes) leaves after the dense weights and
      the KV cache (`committed` bytes): the rest of the machine keeps the other half;
    - `file_room`: the GGUF's size less the dense f32 weights, so that dense weights + expert cache
      hold no more bytes than the file llama.cpp maps whole. Routed experts are read without mapping
      them (ffn.ExpertCache), so colichat's peak RSS (that, + KV + scratch + the quantized pages of
      the dense weights read at load) stays at or below llama.cpp's (file + KV + compute buffers).
      DeepSeek-V2-Lite (11.1 GiB Q4_K/Q8_0 file, 4.9 GiB dense f32): a 6.2 GiB cache, 192 of its
      1,664 routed experts, about 13.5 GiB in all (estimated) beside llama.cpp's 16.2 (measured).
      All experts are cached where they fit (never more slots than the model has experts);

    at least EXPERT_CACHE_MIN_MIB (a few experts of any model). None where the available memory is
    unknown and no file_room is given (then Model uses DEFAULT_EXPERT_CACHE_MIB in place of the first)."""
    if available is None and file_room is None:
        return None
    share = DEFAULT_EXPERT_CACHE_MIB if available is None else EXPERT_CACHE_SHARE * (available - committed) / (1 << 20)
    room = float("inf") if file_room is None else file_room / (1 << 20)
    return max(EXPERT_CACHE_MIN_MIB, min(share, room))


def gguf_bytes(tensors: Tensors) -> int:
    """The size of the GGUF file (all parts of a split model) the tensors are read from."""
    return sum(os.path.getsize(p) for p in set(tensors.files.values()))


def working_bytes(cfg: ModelConfig) -> int:
    """A rough bound of what a pass's buffers take: each thread's tile of a quantized matrix (ops.TILE_BYTES)
    and a prefill chunk's activations (PREFILL_CHUNK rows of the widest products, a few at once), and
    the logits of a verify pass (SMALL_BATCH rows of the vocabulary)."""
    widest = max(cfg.n_embd, 2 * cfg.n_ff, 2 * cfg.n_ff_exp * max(1, cfg.n_expert_shared),
                 cfg.n_head * max(cfg.head_dim, cfg.qk_head))
    return cores() * TILE_BYTES + 4 * (4 * PREFILL_CHUNK * widest + SMALL_BATCH * cfg.n_vocab)


@dataclass(frozen=True)
class MemoryEstimate:
    """What a loaded model needs in memory (bytes), for the load message and the checks before loading."""

    dense: int          # f32 weights held by the model (the numpy path: every dense weight)
    experts: int        # bound of the routed-expert cache (0 without MoE, or with experts read in place)
    experts_f32: int    # what all routed experts would take as f32 (not held)
    kv_per_token: int   # cache bytes per token (record: token id + every layer's rows)
    n_ctx: int
    mtp_per_token: int = 0  # MTP drafting: the block's cache record and a hidden state per token
    mapped: int = 0     # the kernel path: the GGUF bytes multiplied in place (page cache: need not all fit)
    working: int = 0    # a pass's buffers (working_bytes)

    @property
    def held(self) -> int:
        """What must fit in memory: everything but the mapped weights."""
        return self.dense + self.experts + (self.kv_per_token + self.mtp_per_token) * self.n_ctx + self.working

    @property
    def total(self) -> int:
        return self.held + self.mapped

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / (1 << 20):,.0f} MiB"

        s = f"weights {mib(self.dense)}"
        if self.mapped:
            s = f"weights {mib(self.mapped)} mapped from the file + {format_size(self.dense)} as f32"
        if self.experts_f32:  # a bound rounds up: --expert-cache 0.5 is "<= 1 MiB", never "<= 0 MiB"
            s += f" + expert cache <= {-(-self.experts >> 20):,} MiB (all experts as f32: {mib(self.experts_f32)})"
        s += f" + KV {format_size(self.kv_per_token)}/token x {self.n_ctx:,} = {mib(self.kv_per_token * self.n_ctx)}"
        if self.mtp_per_token:
            s += f" + MTP drafts {format_size(self.mtp_per_token)}/token = {mib(self.mtp_per_token * self.n_ctx)}"
        if self.working:
            s += f" + buffers {mib(self.working)}"
        return s + f"; total <= {mib(self.total)}"


class Model:
    """A loaded model with its cache. `prefill` appends tokens after the cached ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict,
        tokenizer,
        n_ctx: int,
        tensors: Tensors | None = None,
        expert_cache: float | None = None,
        numerics: str = "fast",
        mtp: bool = True,
        kernels: str = "numpy",
    ):
        """expert_cache: MiB of dequantized routed experts to keep (MoE models; default:
        auto_expert_cache_mib of what the weights and the cache leave). Routed experts are read
        from `tensors` (the GGUF memory map). numerics: see architectures.forward_class. mtp: keep
        the file's MTP block's draft state (`self.mtp`, fed by every forward; its rows cost memory)
        where it has one and passes are exact (has_mtp). Decided here, once: a draft setting only
        chooses whether Generation asks self.mtp for drafts. kernels: the path the weights were prepared
        for ("numba": the large matrices are QMatrix; "numpy": all f32), as engine.load chose it."""
        self.cfg = cfg
        self.w = weights
        self.tokenizer = tokenizer
        self.tensors = tensors
        self.n_ctx = n_ctx
        mod = architecture(cfg)
        a, b = mod.cache_widths(cfg)
        self.cache = KVCache(mod.CACHE_KIND, cfg.n_layer, a, b, n_ctx,  # + Ic rows of sparse attention
                             cfg.index_head_dim if cfg.n_index_layers else 0, cfg.n_index_layers,
                             cfg.head_dim if mod.CACHE_KIND == "gqa" else 0)  # (a compact GQA row: one head)
        forward = forward_class(mod, numerics)
        if expert_cache is None and cfg.n_expert:
            committed = self.weight_bytes + self.cache.record_bytes * n_ctx
            room = gguf_bytes(tensors) - self.weight_bytes if tensors is not None else None
            expert_cache = auto_expert_cache_mib(available_memory(), committed, room)
            if expert_cache is None:
                expert_cache = DEFAULT_EXPERT_CACHE_MIB
        self.fwd = forward(cfg, weights, tensors, n_ctx, expert_cache)
        self.experts = self.fwd.experts
        self.numerics = numerics
        self.kernels = kernels
        # speculative decoding needs a pass of a few tokens to give decode's exact rows
        self.exact_passes = exact_passes(cfg, numerics)
        self.threads = ThreadPolicy()
        self.mtp = MTPDrafts(self) if mtp and has_mtp(cfg, numerics) else None
        self.mtp_left_out = not mtp and has_mtp(cfg, numerics)  # the file's block, not loaded (mtp=False)
        self.usage_entry = None  # the weights-cache entry keeping the experts' use counts (engine.load sets it)
        self.file_note = None  # a model file found replaced or deleted while this ran (Tensors.whole), to say

    def page_in(self) -> threading.Event | None:
        """Where the whole GGUF fits in the memory this process may use (MemAvailable, and its cgroup's
        limit), map its pages on a thread of its own (Tensors.page_in), so that the first prompt faults
        no page of it in a page at a time; the Event stops it. A larger file is left to the page cache (it
        runs at the disk's speed; mapping it all would only push out what the next token reads): None."""
        if self.tensors is None:
            return None
        room = [n for n in (available_memory(), memory_limit()) if n is not None]
        if not room or gguf_bytes(self.tensors) + self.weight_bytes > 0.9 * min(room):
            return None
        stopped = threading.Event()
        threading.Thread(target=self.tensors.page_in, args=(stopped,), name="colichat-page-in", daemon=True).start()
        return stopped

    # --- public API -------------------------------------------------------------------------------

    def prefill(self, ids, all_logits: bool = True, hidden: bool = False, cancel: Cancel | None = None,
                progress=None):
        """Run new tokens after the cache; logits (T, V) for every new token, or (1, V) for the last.
        hidden=True: (logits, h) with h (T, D) the output_norm'd hidden states of every new token
        (what an MTP block takes, mtp.py; self.mtp is given them of every forward).

        cancel: checked before every layer, and inside one before each block of its matrix products and
        each routed expert's fill and product (the safe points); a stop raises cancel.Cancelled there, and
        the cache keeps none of this call's rows. progress(done): at the same points, `done` the tokens of
        this call read so far (a chunk's layers done count as a fraction of it), so that a long pass shows
        it moves. Every call first checks that the GGUF files mapped are still whole (Tensors.whole:
        ModelError if one was cut short or rewritten in place; Model.file_note if one was replaced)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("prefill needs at least one token")
        if ids.size > self.cache.room():
            raise ModelError(
                f"context full: {self.cache.length} + {ids.size} tokens exceed the context of {self.n_ctx}"
            )
        if ids.min() < 0 or ids.max() >= self.cfg.n_vocab:
            raise ValueError(f"token id out of range 0..{self.cfg.n_vocab - 1}")
        if self.tensors is not None:  # a file cut short under its map: refused before a read could kill the run
            self.file_note = self.tensors.whole() or self.file_note
        out, hs, first, n_layer = [], [], self.cache.length, self.cfg.n_layer
        with self.threads.limit(ids.size), self._safe_points(cancel, progress) as point:
            try:
                for start in range(0, ids.size, PREFILL_CHUNK):
                    chunk = ids[start : start + PREFILL_CHUNK]
                    last = start + chunk.size == ids.size
                    pos0 = self.cache.length
                    x = self._forward(chunk, lambda l, a=start, t=chunk.size: point(a + t * l / n_layer))  # (T, D)
                    if hidden or self.mtp is not None:
                        h = rms_norm(x, self.w["output_norm"], self.cfg.rms_eps)  # (T, D)
                        if self.mtp is not None:
                            self.mtp.observe(pos0, h)
                        if hidden:
                            hs.append(h)
                    if all_logits:
                        out.append(self.fwd.logits(x))
                    elif last:
                        out.append(self.fwd.logits(x[-1:]))
            except BaseException:  # (a stop, or a failure midway: the chunks before go too)
                self.cache.truncate(first)
                raise
        logits = np.concatenate(out) if len(out) > 1 else out[0]
        if progress:
            progress(ids.size)
        return (logits, np.concatenate(hs)) if hidden else logits

    def decode(self, token_id: int, cancel: Cancel | None = None) -> np.ndarray:
        """One token after the cache: logits (V,). cancel: as prefill's."""
        return self.prefill([token_id], all_logits=False, cancel=cancel)[0]

    @contextmanager
    def quiet(self):
        """While colichat answers (a prompt read, an answer generated): the background work (the routed
        experts' warm start, ExpertCache.warm) waits, so that it takes no core from the answer."""
        if self.experts is None:
            yield
            return
        with self.experts.paused():
            yield

    def warming(self) -> tuple[int, int] | None:
        """(experts filled, experts to fill) while the experts' warm start is still under way, else None."""
        e = self.experts
        if e is None or e.warmer is None or not e.warmer.is_alive() or e.warmed >= e.warming:
            return None
        return e.warmed, e.warming

    def keep_expert_usage(self) -> None:
        """Write the routed experts' use counts beside the weights cache, for the next start's warm
        start (MoE models loaded with a cache_dir; never raises)."""
        if self.experts is not None and self.usage_entry is not None:
            write_usage(self.usage_entry, self.experts.usage())

    def reset(self) -> None:
        """An empty cache, rotated with the factors this context size picks (a new conversation)."""
        self.cache.reset()
        if self.rope_factors is not None:
            self.use_rope_factors(self.fwd.default_rope_factors)  # (no-op when already in use)

    @property
    def rope_factors(self) -> str | None:
        """The rope frequency factors the cache rows are rotated with, where the architecture picks
        them by context size ("short" or "long": minicpm3's LongRoPE); None where the rope is the same
        at every context size. A session records it (persist: the sidecar's model.rope_factors)."""
        return getattr(self.fwd, "rope_factors", None)

    def use_rope_factors(self, name: str | None) -> None:
        """Rotate with the factors `name` from now on, whatever this context size picks: for a
        conversation whose rows were made with them (a resumed one). ModelError (one line, saying
        why) where that cannot be right. reset() goes back to this context size's factors."""
        if name == self.rope_factors:
            return
        problem = rope_factors_problem(self.cfg, self.n_ctx, name)
        if problem:
            raise ModelError(problem)
        self.fwd.use_rope_factors(name)

    @property
    def output(self) -> np.ndarray:
        """The output matrix (V, D): output.weight, or the tied token embedding."""
        return self.w[self.cfg.output_weight]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the f32 weights the model holds (on the kernel path, what is not multiplied in place)."""
        return sum(a.nbytes for a in self.w.values() if isinstance(a, np.ndarray))

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the GGUF the kernel path multiplies in place: its QMatrix weights and routed experts."""
        n = sum(a.nbytes for a in self.w.values() if isinstance(a, QMatrix))
        if isinstance(self.experts, MappedExperts):
            n += sum(self.tensors.nbytes(name) for name in self.tensors.by_name if "_exps." in name)
        return n

    def memory_estimate(self) -> MemoryEstimate:
        """f32 weights + the expert-cache bound + KV bytes per token x context + what is mapped + buffers."""
        cfg, all_f32, bound = self.cfg, 0, 0
        if isinstance(self.experts, ExpertCache):  # never more than all experts, nor less than one (scratch)
            all_f32 = 3 * cfg.n_ff_exp * cfg.n_embd * 4 * cfg.n_expert * len(self.experts.layers)  # gate, up, down
            bound = max(min(self.experts.capacity, all_f32), self.experts.slab.nbytes)
        return MemoryEstimate(self.weight_bytes, bound, all_f32, self.cache.record_bytes, self.n_ctx,
                              mtp_bytes_per_token(cfg) if self.mtp is not None else 0, self.mapped_bytes,
                              working_bytes(cfg))

    # --- internals --------------------------------------------------------------------------------

    @contextmanager
    def _safe_points(self, cancel: Cancel | None, progress):
        """A pass's safe points: yields point(done), which checks `cancel` and tells `progress` the tokens
        done; inside a layer, the products' blocks and the routed experts call it again (ops.SAFE_POINT)."""
        if cancel is None and progress is None:
            yield lambda done: None
            return
        at = [0.0]

        def point(done: float | None = None) -> None:
            if cancel is not None:
                cancel.check()
            at[0] = at[0] if done is None else done
            if progress:
                progress(at[0])

        token = SAFE_POINT.set(point)
        try:
            yield point
        finally:
            SAFE_POINT.reset(token)

    def _forward(self, ids: np.ndarray, point=lambda l: None) -> np.ndarray:
        """The layers over ids (T,) after the cache; point(l) before layer l (a safe point: it may raise)."""
        pos0 = self.cache.length
        t = ids.size
        self.cache.tokens[pos0 : pos0 + t] = ids
        x = self.w["token_embd"][ids]  # (T, D)
        for l in range(self.cfg.n_layer):
            point(l)
            x = self.fwd.layer(l, x, pos0, self.cache)
        self.cache.length = pos0 + t
        return x
