"""Helpers shared by the persist tests (imported by them and by their child processes).

Caches here are filled from a deterministic generator seeded by turn index, so a test (or a child
process) can always say which records a session should hold for its first m turns.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from colichat.engine.cache import KVCache
from colichat.persist import CacheLayout, Turn

TESTS = Path(__file__).resolve().parent
VOCAB = 1000
DIMS = {"mla": (3, 16, 4), "gqa": (2, 8, 8)}  # n_layer, a_width, b_width
IDENT = {"arch": "deepseek2", "name": "Tiny Test/Model", "fingerprint": "0123456789abcdef" * 2}
OTHER_IDENT = {"arch": "deepseek2", "name": "Tiny Test/Model", "fingerprint": "fedcba9876543210" * 2}
ROLES = ("user", "assistant")


class Ticks:
    """A clock to inject (Store(clock=...)): each reading a second after the one before, from a fixed
    start, so saves and reopenings are ordered in time without a test sleeping between them; `wait`
    moves it on further."""

    def __init__(self, start: float = 1_800_000_000.0):
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


def parse_colikv1(data: bytes) -> tuple[tuple, list, int]:
    """The tests' one COLIKV1 parser, written with struct from the format's text (independent of colichat's
    record dtype): (magic, n_layers, a_w, b_w, index_hd, n_idx, vocab, nrec, zero), then per record
    (token, [(a floats, b floats) per layer], [index keys per indexed layer]), and where the records end."""
    n_layers, a_w, b_w, index_hd, n_idx, vocab, nrec, zero = struct.unpack("<8i", data[8:40])
    pos, records = 40, []
    for _ in range(nrec):
        (token,) = struct.unpack_from("<i", data, pos)
        pos += 4
        layers = []
        for _ in range(n_layers):
            a = struct.unpack_from(f"<{a_w}f", data, pos)
            b = struct.unpack_from(f"<{b_w}f", data, pos + 4 * a_w)
            pos += 4 * (a_w + b_w)
            layers.append((a, b))
        ic = []
        for _ in range(n_idx):
            ic.append(struct.unpack_from(f"<{index_hd}f", data, pos))
            pos += 4 * index_hd
        records.append((token, layers, ic))
    return (data[:8], n_layers, a_w, b_w, index_hd, n_idx, vocab, nrec, zero), records, pos


def make_cache(kind: str = "mla", capacity: int = 4096) -> KVCache:
    return KVCache(kind, *DIMS[kind], capacity)


def layout_of(cache: KVCache) -> CacheLayout:
    return CacheLayout.from_cache(cache, VOCAB)


def turn_len(i: int) -> int:
    return 1 + (i * 7919) % 23


def plan(n_turns: int) -> list[Turn]:
    """The first n_turns turns of every test conversation: contiguous, varied lengths."""
    turns, first = [], 0
    for i in range(n_turns):
        last = first + turn_len(i)
        turns.append(Turn(ROLES[i % 2], f"turn {i}: h\u00e9llo \U0001f600", first, last))
        first = last
    return turns


def fill_turn(cache: KVCache, i: int, t: Turn) -> None:
    """Write turn i's records (what the engine would have computed) into the cache."""
    rng = np.random.default_rng(1000 + i)
    n = t.last - t.first
    cache.records["token"][t.first : t.last] = rng.integers(0, VOCAB, n)
    cache.records["kv"][t.first : t.last] = rng.standard_normal(cache.records["kv"][t.first : t.last].shape)
    cache.set_length(t.last)


def build(cache: KVCache, n_turns: int) -> list[Turn]:
    """Fill the cache with the first n_turns turns; return them."""
    turns = plan(n_turns)
    for i, t in enumerate(turns):
        fill_turn(cache, i, t)
    cache.set_length(turns[-1].last if turns else 0)
    return turns


def expected_records(kind: str, n_turns: int) -> np.ndarray:
    c = make_cache(kind, 8192)
    turns = build(c, n_turns)
    return c.records[: turns[-1].last if turns else 0].copy()


def snapshot(directory) -> dict:
    """Bytes and mtime of every session file (lock files excluded: opening writes the pid there)."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        if p.suffix != ".lock":
            st = os.lstat(p)
            out[p.name] = (p.read_bytes() if p.is_file() and not p.is_symlink() else None, st.st_mtime_ns)
    return out
