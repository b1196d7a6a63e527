"""Feed-forward blocks. Axis letters: T tokens, D model width, F hidden width."""

from __future__ import annotations

import numpy as np

from .ops import silu


def swiglu(x: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """W_down (silu(W_gate x) * W_up x). x: (T, D); w_gate_up: (2F, D) = [gate; up]; w_down: (D, F)."""
    f = w_down.shape[1]
    gu = x @ w_gate_up.T  # (T, 2F)
    h = silu(gu[:, :f]) * gu[:, f:]  # (T, F)
    return h @ w_down.T  # (T, D)
