"""Rotary position embeddings as llama.cpp computes them: NORM and NEOX pairing, YaRN, frequency factors.

Axis letters: engine/__init__.py (P positions, I rotated pairs = n_dims / 2, T tokens, H heads).

deepseek2, plm, llama (on GGUF weights) rotate adjacent pairs (x[2i], x[2i+1]) ("NORM"), minicpm3
the pairs (x[i], x[i + n_dims/2]) ("NEOX"); the angle of pair i at position p is
p * base^(-2i/n_dims) / ff_i (ff: per-pair frequency factors, e.g. LongRoPE's), blended by YaRN
between interpolation (freq_scale * theta) and extrapolation (theta) with a ramp over the
correction dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeParams:
    n_dims: int                 # rotated dims (n_rot)
    base: float
    freq_scale: float = 1.0     # 1 / scaling factor
    ext_factor: float = 0.0     # 1 for YaRN, else 0
    n_ctx_orig: int = 0         # YaRN original context
    attn_factor: float = 1.0    # magnitude multiplier passed to the rope op
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def yarn_corr_dims(p: RopeParams) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pair range over which YaRN blends."""

    def corr_dim(n_rot: float) -> float:
        return p.n_dims * math.log(p.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(p.base))

    low = max(0.0, math.floor(corr_dim(p.beta_fast)))
    high = min(p.n_dims - 1.0, math.ceil(corr_dim(p.beta_slow)))
    return low, high


def rope_tables(p: RopeParams, n_pos: int, freq_factors: np.ndarray | None = None):
    """cos and sin (with the YaRN magnitude folded in) for positions 0..n_pos-1: two (P, I) float32."""
    i = np.arange(p.n_dims // 2, dtype=np.float64)  # (I,)
    inv_freq = p.base ** (-2.0 * i / p.n_dims)  # (I,)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    mscale = p.attn_factor
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        y = (i - low) / max(0.001, high - low)
        ramp = (1.0 - np.clip(y, 0.0, 1.0)) * p.ext_factor  # (I,) 1 = extrapolate
        inv_freq = inv_freq * p.freq_scale * (1.0 - ramp) + inv_freq * ramp
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    else:
        inv_freq = inv_freq * p.freq_scale
    theta = np.arange(n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]  # (P, I)
    cos = (np.cos(theta) * mscale).astype(np.float32)
    sin = (np.sin(theta) * mscale).astype(np.float32)
    return cos, sin


def rope_rotations(p: RopeParams, n_pos: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """The rotations e^(i theta) (magnitude folded in) as complex64 (P, I), for rope_norm."""
    cos, sin = rope_tables(p, n_pos, freq_factors)
    rot = np.empty(cos.shape, dtype=np.complex64)
    rot.real, rot.imag = cos, sin
    return rot


def rope_norm(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs of the last axis: each pair (a, b) read as the complex a + ib times
    e^(i theta), i.e. (a cos - b sin, a sin + b cos). x: (T, ..., 2I); rot: (T, I) for x's positions."""
    shape = x.shape
    xc = np.ascontiguousarray(x).view(np.complex64).reshape(shape[0], -1, shape[-1] // 2)  # (T, *, I)
    return (xc * rot[:, None, :]).view(np.float32).reshape(shape)


def rope_neox(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """Rotate the pairs (x[i], x[i + I]) of the last axis ("NEOX", as llama.cpp's minicpm3):
    (a cos - b sin, a sin + b cos). x: (T, ..., 2I); rot: (T, I) for x's positions."""
    i = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (i,)
    cos, sin = rot.real.reshape(shape), rot.imag.reshape(shape)
    a, b = x[..., :i], x[..., i:]
    out = np.empty(x.shape, dtype=np.float32)
    out[..., :i] = a * cos - b * sin
    out[..., i:] = a * sin + b * cos
    return out
