"""llama.cpp's CPU arithmetic, reproduced operation by operation in numpy (the "llama.cpp" numerics).

The fast engine computes each op as exactly as float32 allows, which is not what llama.cpp does:
it rounds activations to 8 bits before every Q8_0 matmul, sums in a fixed lane order, uses its own
exp, and builds RoPE angles by repeated float products. On a long prompt through a MoE model one
differently rounded activation can tip an expert-routing near-tie, so agreeing with llama.cpp to a
tight tolerance needs its arithmetic, bit for bit. This module holds that arithmetic, as ggml
computes it on an x86 build with AVX-512 (the `ggml-cpu` backend, its `llamafile` sgemm):

- fma: one rounding (emulated in float64; exact but for negligible double-rounding cases);
- Q8_0 x activations: activations quantized per 32 (d = amax/127 as fp16, round half to even),
  each block's int8 products summed in 8 lanes of 4, the lanes accumulated with fma over the
  blocks, then added pairwise (`hsum`);
- f32 x f32 (tinyBLAS): 16 lanes accumulated with fma along k, then `_mm512_reduce_add_ps`;
  lengths not a multiple of 16 fall back to `ggml_vec_dot_f32` (4 x 16 lanes, then a scalar tail);
- exp: `ggml_v_expf` (AVX-512 form); expf where ggml calls the C library (sigmoid), correctly
  rounded here;
- rms_norm: squares summed in double, one float scale; soft_max: ggml_v_expf, double sum, one
  float 1/sum; SiLU: x / (1 + v_expf(-x));
- RoPE: angles by the float recurrence theta *= theta_scale, YaRN blend in float, cos/sin rounded.

Which build: the reference data in ../shared/ref matches the AVX-512 forms (16-lane sums, the
AVX-512 ggml_v_expf) and no fma contraction in RoPE; the AVX2 forms give more flipped roundings.

Slow (every matmul is a loop of lane sums and emulated fmas): meant for checking the model against
llama.cpp, not for chatting with large models. Shapes: T tokens, N outputs, K inputs.
"""

from __future__ import annotations

import math

import numpy as np

from .rope import RopeParams, yarn_corr_dims

F32, F64 = np.float32, np.float64
LANES = 16  # AVX-512 float lanes (tinyBLAS KN, ggml_vec_dot_f32 EPR)


def fma(a, b, c) -> np.ndarray:
    """a * b + c with one float32 rounding."""
    return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


def hsum(acc: np.ndarray) -> np.ndarray:
    """Sum the last axis (8 or 16 lanes) in the order of hsum(__m256) / _mm512_reduce_add_ps."""
    if acc.shape[-1] == 16:
        acc = (acc[..., 8:] + acc[..., :8]).astype(F32)
    q = (acc[..., 4:] + acc[..., :4]).astype(F32)  # (..., 4)
    return ((q[..., 0] + q[..., 2]).astype(F32) + (q[..., 1] + q[..., 3]).astype(F32)).astype(F32)


_EXP = [float.fromhex(h) for h in ("0x1.715476p+0", "0x1.7f7d1cp-20", "0x1.62e4p-1", "0x1.0e4020p-7",
                                   "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]


def v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX-512): exp in float32 as ggml's softmax and SiLU compute it."""
    x = np.asarray(x, F32)
    log2e, ln2_lo, ln2_hi, c5, c4, c3, c2, c1 = (F32(v) for v in _EXP)
    r = F32(12582912.0)  # 0x1.8p23: rounds x / ln2 to an integer
    with np.errstate(invalid="ignore", over="ignore"):
        z = fma(x, log2e, r)
        n = (z - r).astype(F32)
        b = fma(-n, ln2_lo, fma(-n, ln2_hi, x))
        u = (b * b).astype(F32)
        j = fma(fma(fma(c5, b, c4), u, fma(c3, b, c2)), u, fma(c1, b, F32(1)))
        small = np.abs(n) <= 192  # beyond: ggml flushes to 0 or inf
        k = np.where(small, n, 0).astype(np.int32)
        out = np.ldexp(j.astype(F64), k).astype(F32)  # scalef: j * 2^n, one rounding
        if not small.all():
            out = np.where(small, out, np.where(x > 0, F32(np.inf), F32(0)))
    return out


def expf(x: np.ndarray) -> np.ndarray:
    """The C library's expf (correctly rounded here)."""
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, F64)).astype(F32)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_0 on rows of x (T, K): int8 values (T, K/32, 32), fp16 scales as f32 (T, K/32)."""
    b = np.ascontiguousarray(x, dtype=F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)  # (T, K/32, 1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((b * inv).astype(F32)).astype(np.int8)  # round half to even (_mm256_round_ps)
    d = (amax[..., 0] / F32(127)).astype(np.float16).astype(F32)
    return q, d


class GgmlWeight:
    """A matmul weight as the GGUF stores it, multiplied as ggml does (x (T, K) -> (T, N)):
    F32 (f (N, K)) or Q8_0 (q int8 (N, K/32, 32), d (N, K/32))."""

    def __init__(self, kind: str, q=None, d=None, f=None):
        self.kind, self.q, self.d, self.f = kind, q, d, f

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.kind == "F32":
            return matmul_f32(x, self.f)
        return matmul_q8_0(x, self.q, self.d)


KINDS = ("F32", "Q8_0")  # the weight types these numerics multiply like llama.cpp


def read_weight(t, name: str, expert: int | None = None, head: int | None = None) -> GgmlWeight:
    """One weight of Tensors `t` (one expert of a *_exps tensor, one head of a 3-D tensor)."""
    kind = t.qtype(name).name
    if kind == "F32":
        f = t.f32(name, expert)
        return GgmlWeight(kind, f=f if head is None else f[head])
    data = t.require(name).data
    data = data if expert is None else data[expert]
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, 34)  # (blocks, fp16 d + 32 int8)
    shape = t.shape(name)[0 if expert is None else 1:-1] + (-1,)  # (..., N, K/32)
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32).reshape(shape)
    q = blocks[:, 2:].view(np.int8).reshape(shape + (32,))
    if head is not None:
        q, d = q[head], d[head]
    return GgmlWeight(kind, q, d)  # q: a view of the memory-mapped file


def matmul_q8_0(x: np.ndarray, wq: np.ndarray, wd: np.ndarray, rows: int = 16) -> np.ndarray:
    """x (T, K) times Q8_0 weights wq (N, K/32, 32) int8, wd (N, K/32) -> (T, N), as
    ggml_vec_dot_q8_0_q8_0 and tinyBLAS_Q0 sum it: activations quantized per 32; per block 8 lanes
    of 4 integer products, scaled by d_w * d_x and accumulated with fma over the blocks; hsum."""
    xq, xd = quantize_q8_0(x)
    t, nb = xd.shape
    n = wq.shape[0]
    wl = wq.reshape(n, nb, 8, 4).transpose(1, 2, 3, 0).astype(F32)  # (nb, 8, 4, N)
    out = np.empty((t, n), dtype=F32)
    for i0 in range(0, t, rows):
        xl = xq[i0:i0 + rows].reshape(-1, nb, 8, 4).transpose(1, 2, 0, 3).astype(F32)  # (nb, 8, t, 4)
        acc = np.zeros((xl.shape[2], n, 8), dtype=F32)  # (t, N, 8)
        for blk in range(nb):
            lanes = np.matmul(xl[blk], wl[blk]).transpose(1, 2, 0)  # (t, N, 8), exact: |sum| < 2^24
            dd = (wd[None, :, blk] * xd[i0:i0 + rows, blk, None]).astype(F32)  # (t, N)
            acc = fma(dd[..., None], lanes, acc)
        out[i0:i0 + rows] = hsum(acc)
    return out


def matmul_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, K) times w (N, K) -> (T, N): tinyBLAS order when K is a multiple of 16, else
    ggml_vec_dot_f32's (4 accumulators of 16 lanes over 64-wide steps, then a scalar tail)."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    k = x.shape[1]
    if k % LANES == 0:
        acc = np.zeros((x.shape[0], w.shape[0], LANES), dtype=F32)  # (T, N, 16)
        for l0 in range(0, k, LANES):
            acc = fma(x[:, None, l0:l0 + LANES], w[None, :, l0:l0 + LANES], acc)
        return hsum(acc)
    step = 4 * LANES
    body = k - k % step
    acc = [np.zeros((x.shape[0], w.shape[0], LANES), dtype=F32) for _ in range(4)]
    for l0 in range(0, body, step):
        for j in range(4):
            s = slice(l0 + j * LANES, l0 + (j + 1) * LANES)
            acc[j] = fma(x[:, None, s], w[None, :, s], acc[j])
    out = hsum(((acc[0] + acc[2]).astype(F32) + (acc[1] + acc[3]).astype(F32)).astype(F32))
    for i in range(body, k):
        out = (out + (x[:, None, i] * w[None, :, i]).astype(F32)).astype(F32)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm then the weight multiply: squares (float) summed in double in order."""
    x = np.asarray(x, F32)
    total = np.cumsum((x * x).astype(F64), axis=-1)[..., -1:]  # sequential double sum
    mean = (total / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return ((x * scale).astype(F32) * weight).astype(F32)


def soft_max(s: np.ndarray) -> np.ndarray:
    """ggml_soft_max on rows (already scaled and masked with -inf)."""
    e = v_expf((s - s.max(axis=-1, keepdims=True)).astype(F32))
    total = np.cumsum(e.astype(F64), axis=-1)[..., -1:]
    return (e * (1.0 / total).astype(F32)).astype(F32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32: x / (1 + v_expf(-x)) * g."""
    e = v_expf((F32(0) - gate).astype(F32))
    return ((gate / (F32(1) + e).astype(F32)).astype(F32) * up).astype(F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml_vec_sigmoid_f32: 1 / (1 + expf(-x))."""
    return (F32(1) / (F32(1) + expf(-np.asarray(x, F32))).astype(F32)).astype(F32)


def rope_cache(p: RopeParams, n_pos: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ggml_rope_cache_init for positions 0..n_pos-1: cos, sin (P, I) float32, magnitude folded in."""
    i_pairs = p.n_dims // 2
    theta_scale = F32(float(F32(p.base)) ** (-2.0 / p.n_dims))  # powf
    fs = F32(p.freq_scale)
    mscale = F32(p.attn_factor)
    low = high = 0.0
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        ln = F32(math.log(float(F32(1) / fs)))  # logf(1 / freq_scale)
        mscale = F32(mscale * F32(F32(1) + F32(F32(0.1) * ln)))
    cos = np.empty((n_pos, i_pairs), dtype=F32)
    sin = np.empty((n_pos, i_pairs), dtype=F32)
    theta = np.arange(n_pos, dtype=F32)  # theta_base = p, per position
    for i in range(i_pairs):
        extrap = theta if freq_factors is None else (theta / F32(freq_factors[i])).astype(F32)
        interp = (fs * extrap).astype(F32)
        angle = interp
        if p.ext_factor != 0.0:
            y = F32(F32(i - low) / F32(max(0.001, high - low)))
            mix = F32(F32(1) - F32(min(1.0, max(0.0, float(y))))) * F32(p.ext_factor)
            angle = ((interp * F32(1 - mix)).astype(F32) + (extrap * mix).astype(F32)).astype(F32)
        cos[:, i] = (np.cos(angle.astype(F64)).astype(F32) * mscale).astype(F32)  # cosf(theta) * mscale
        sin[:, i] = (np.sin(angle.astype(F64)).astype(F32) * mscale).astype(F32)
        theta = (theta * theta_scale).astype(F32)
    return cos, sin


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs of x (T, ..., 2I) by the (T, I) tables, each product rounded."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty(x.shape, dtype=F32)
    out[..., 0::2] = ((x0 * c).astype(F32) - (x1 * s).astype(F32)).astype(F32)
    out[..., 1::2] = ((x0 * s).astype(F32) + (x1 * c).astype(F32)).astype(F32)
    return out
