"""Routed experts on the kernel path: multiplied where they lie in the GGUF's memory map (MappedExperts),
with the interface of ffn.ExpertCache that ffn.moe() and Model use. Axis letters: engine/__init__.py.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .gguf import kernels
from .gguf.qmatrix import stack


class MappedExperts:
    """Routed experts multiplied where they lie in the GGUF's memory map, by the compiled kernels (the
    kernel path, where in_place() holds): the page cache is the expert cache, as llama.cpp's. Nothing is
    read ahead, copied or dequantized: `fetch(layer, es)` gives each expert's (gate_up (2F, D), down
    (D, F)) as QMatrix views of the map (the gate and up parts stacked, not copied), the pages a product
    touches read by the kernel on first use. The interface is ExpertCache's that moe() and Model use;
    the use counts are kept the same way (usage()), for a later start on the numpy path."""

    prefetcher = None  # nothing to prefetch: a product reads the pages it needs
    warming = warmed = 0
    warmer = None  # nothing to warm (Model.warming)

    def __init__(self, tensors, layers: list[int]):
        self.tensors, self.layers = tensors, set(layers)
        self.order = {l: i for i, l in enumerate(layers)}  # expert index k = order[layer] * X + e
        x, d, f = tensors.shape(f"blk.{layers[0]}.ffn_down_exps.weight")  # (X, D, F)
        self.n_expert, self.shape, self.batch = x, (f, d), x
        self.counts = np.zeros(x * len(layers), dtype=np.float64)  # (L X,) aged use counts (ExpertCache's)
        self.aging, self.tick = x * len(layers), 0
        self.made: dict[tuple[int, int], tuple] = {}  # (layer, e) -> its (gate_up, down) QMatrix views

    def fetch(self, layer: int, es: list[int]) -> list[tuple]:
        """(gate_up, down) of experts `es` of `layer`, as QMatrix views of the map."""
        for e in es:
            self.tick += 1
            self.counts[self.order[layer] * self.n_expert + e] += 1
            if self.tick % self.aging == 0:
                self.counts *= 0.5
        return [self.made.get((layer, e)) or self._make(layer, e) for e in es]

    def _make(self, layer: int, e: int) -> tuple:
        t, b = self.tensors, f"blk.{layer}."
        if t.has(b + "ffn_gate_up_exps.weight"):
            gate_up = t.qmatrix(b + "ffn_gate_up_exps.weight", e)  # (2F, D)
        else:
            gate_up = stack([t.qmatrix(b + "ffn_gate_exps.weight", e), t.qmatrix(b + "ffn_up_exps.weight", e)])
        made = self.made[(layer, e)] = (gate_up, t.qmatrix(b + "ffn_down_exps.weight", e))  # (D, F)
        return made

    def prefetch(self, layer: int, es: list[int]) -> None:
        """Nothing to do: the kernels read what they use."""

    def usage(self) -> np.ndarray:
        """The aged use counts of every routed expert (L X,), as ExpertCache.usage."""
        return self.counts.astype(np.float32)

    def warm(self, counts: np.ndarray) -> None:
        """Nothing to fill (the page cache keeps what earlier runs read)."""

    def paused(self):
        """While colichat answers (Model.quiet): nothing runs in the background to pause."""
        return contextlib.nullcontext()


def in_place(tensors, layers: list[int]) -> bool:
    """Whether the routed experts of `layers` can be multiplied in the map (MappedExperts): the kernel
    path (tensors.kernels) and a type the kernels take (F32 experts go through the ExpertCache)."""
    if not tensors.kernels:
        return False
    names = [n for l in layers for n in tensors.by_name if n.startswith(f"blk.{l}.") and "_exps." in n]
    return all(tensors.qtype(n).name != "F32" and kernels.supported(tensors.qtype(n).name) for n in names)
