"""A quantized matrix: the rows of GGUF tensors as they lie in the memory map, never expanded to f32
as a whole; the compiled kernels (kernels.py) multiply by them block by block.

    w = tensors.qmatrix("blk.0.attn_q.weight")        # QMatrix, shape (O, Z): nothing read or copied
    w = stack([q, k, v])                              # q|k|v as one matrix (each part keeps its type)
    y = w.matvec(x, a, b)                             # (T, b-a) = x (T, Z) @ rows a..b of w (w.takes(T))
    tile = w.dequantize(a, b, out)                    # rows a..b as f32 into a reused buffer (prefill)

A QMatrix is one or more parts stacked by rows (Part: a type name as kernels take it, the rows
(O_i, row_bytes) uint8 viewed in the map, the first output row). Stacking costs nothing: the fused
projections of the f32 path (q|k|v, gate|up, q_a|kv_a_mqa) are one QMatrix whose product is one
kernel call per part, so an architecture calls one `linear` on it as on an f32 array (ops.linear
chooses the path by type) and never asks which it holds. Row ranges (a, b) given to matvec and
dequantize never cross a part (edges() says where parts end).

Axis letters: engine/__init__.py (O outputs, Z the summed axis, T rows of x).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import kernels


class Part(NamedTuple):
    """One tensor (or one expert of a 3-D tensor) in a QMatrix."""

    qtype: str         # gguf.GGMLQuantizationType name: "Q4_K", "Q8_0", "F16", ...
    rows: np.ndarray   # (O_i, row_bytes) uint8, a view of the memory map
    start: int         # its first output row in the QMatrix
    source: tuple      # (GGUF tensor name, expert or None): where the rows come from (gguf/prepared.py)


class QMatrix:
    """A (O, Z) matrix held as GGUF blocks: parts stacked by rows (module docstring)."""

    def __init__(self, parts: list[tuple[str, np.ndarray, tuple]], z: int):
        """parts: (type name, rows (O_i, row_bytes) uint8, source) each; z: the values in a row."""
        self.parts, at = [], 0
        for qtype, rows, source in parts:
            rows = rows.reshape(rows.shape[0], -1).view(np.uint8)  # (O_i, row_bytes)
            per, size = kernels.block(qtype)
            if z % per or rows.shape[1] != z // per * size:
                raise ValueError(f"{qtype} rows of {rows.shape[1]} bytes do not hold {z} values")
            self.parts.append(Part(qtype, rows, at, source))
            at += rows.shape[0]
        self.shape = (at, z)
        self.dtype = np.dtype(np.float32)  # what products with it give

    @property
    def nbytes(self) -> int:
        """The quantized bytes a product reads (what the map holds, not an f32 size)."""
        return sum(p.rows.nbytes for p in self.parts)

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(p.qtype for p in self.parts)

    def edges(self, rows: int | None = None) -> list[int]:
        """Block edges [0, ..., O] from the shape alone: every part's ends, and within a part every
        `rows` rows (a multiple of 16, or the whole part for None)."""
        out = [0]
        for p in self.parts:
            n = p.rows.shape[0]
            step = n if rows is None else max(16, rows // 16 * 16)
            out += [p.start + a for a in range(step, n, step)] + [p.start + n]
        return out

    def _part(self, a: int, b: int) -> Part:
        for p in self.parts:
            if p.start <= a and b <= p.start + p.rows.shape[0]:
                return p
        raise ValueError(f"rows {a}..{b} cross a part of {self.shape}")

    def takes(self, t: int) -> bool:
        """Whether matvec takes t rows of x: up to ops.SMALL_BATCH for every type, more where every part's
        type rounds x to 8 bits and its integer products beat a dequantized tile (kernels.takes)."""
        return all(kernels.takes(q, t) for q in self.qtypes)

    def rounded(self, x: np.ndarray) -> dict:
        """x (T, Z) f32 as each part's type takes it (kernels.rounded), each rounding computed once:
        {type name: x's}; matvec takes it in place of x (a product split into row blocks)."""
        by_kind, out = {}, {}
        for q in dict.fromkeys(self.qtypes):
            kind = kernels.rounding(q)
            if kind not in by_kind:
                by_kind[kind] = kernels.rounded(q, x)
            out[q] = by_kind[kind]
        return out

    def matvec(self, x, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """x (T, Z) f32 (or self.rounded(x)) @ rows a..b (within one part) -> (T, b-a), for T that
        takes(T) allows; the bits of each output do not depend on T, on a and b, nor on the thread that
        computes it."""
        p = self._part(a, b)
        xs = x[p.qtype] if isinstance(x, dict) else x
        if out is None:
            t = xs.shape[0] if isinstance(xs, np.ndarray) else xs[1].shape[0]
            out = np.empty((t, b - a), dtype=np.float32)  # (T, b-a)
        kernels.matvec(p.qtype, p.rows[a - p.start : b - p.start], xs, out)
        return out

    def dequantize(self, a: int, b: int, out: np.ndarray) -> np.ndarray:
        """Rows a..b (within one part) as f32 into the front of `out` (a buffer of at least (b-a) Z
        float32, reused): returns that (b-a, Z) view."""
        p = self._part(a, b)
        tile = out.reshape(-1)[: (b - a) * self.shape[1]].reshape(b - a, self.shape[1])  # (b-a, Z)
        kernels.dequantize(p.qtype, p.rows[a - p.start : b - p.start], tile)
        return tile

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (T,) as f32 (T, Z): an embedding lookup, the same values as the f32 path's."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.size, self.shape[1]), dtype=np.float32)  # (T, Z)
        for p in self.parts:
            mine = (ids >= p.start) & (ids < p.start + p.rows.shape[0])
            if mine.any():
                out[mine] = self._rows(p, p.rows[ids[mine] - p.start])
        return out

    def _rows(self, p: Part, raw: np.ndarray) -> np.ndarray:
        tile = np.empty((raw.shape[0], self.shape[1]), dtype=np.float32)
        kernels.dequantize(p.qtype, np.ascontiguousarray(raw), tile)
        return tile

    def f32(self) -> np.ndarray:
        """The whole matrix as f32 (O, Z): for tests, and for stacking with an f32 array."""
        return np.concatenate([self._rows(p, p.rows) for p in self.parts])

    def __getitem__(self, ids):
        return self.take(ids)


def stack(ws: list) -> QMatrix | np.ndarray:
    """Matrices (O_i, Z) stacked by rows: a QMatrix when all are (no copy), else one f32 array."""
    if all(isinstance(w, QMatrix) for w in ws):
        return QMatrix([(p.qtype, p.rows, p.source) for w in ws for p in w.parts], ws[0].shape[1])
    return np.concatenate([w.f32() if isinstance(w, QMatrix) else w for w in ws])
