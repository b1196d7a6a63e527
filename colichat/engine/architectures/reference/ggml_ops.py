"""llama.cpp's CPU arithmetic, reproduced operation by operation in numpy (the "llama.cpp" numerics).

The fast engine computes each op as exactly as float32 allows, which is not what llama.cpp does:
it rounds activations to 8 bits before quantized matmuls, sums in fixed lane orders, uses its own
exp, and builds RoPE angles by repeated float products. Near-ties (an activation halfway between two
8-bit values, two experts with almost the same routing score) then fall differently, and one flip
moves the logits by up to ~2 on a MoE model. This module holds llama.cpp's arithmetic as its x86
build with AVX-512 runs it (the `ggml-cpu` backend with its `llamafile` sgemm); with it the logits
are llama.cpp's, bit for bit (tests/test_llama_cpp_numerics.py):

- fma: one rounding (emulated in float64; exact but for negligible double-rounding cases);
- Q8_0 / Q4_1 x activations: activations quantized per 32 (d = amax/127 as fp16, round half to
  even), each block's integer products summed in 8 lanes of 4, the lanes accumulated with fma over
  the blocks, then added pairwise (`hsum`); Q4_1 adds its minimums times the blocks' sums;
- the K-quants and IQ4 (INT8_KINDS) x activations: the compiled kernels' products (x rounded to Q8_K
  or Q8_0, the same integer sums), their last float sums in the kernels' order: within a stated
  bound of llama.cpp, not bit for bit (tests/test_quant_types.py);
- f32 x f32: tinyBLAS (16 lanes accumulated with fma along k, then `_mm512_reduce_add_ps`) when
  there are two or more columns, k is a multiple of 16 and the operand is contiguous; otherwise
  `ggml_vec_dot_f32` (4 x 16 lanes over 64-wide steps, then a scalar tail). Attention scores are
  always the latter (the query is a permuted view), and so are f32 routed experts (mul_mat_id);
- exp: `ggml_v_expf` (AVX-512 form); the C library's expf where ggml calls it (sigmoid, the
  scalar tails of soft_max); soft_max sums 16-wide chunks in float and the chunks in double;
- rms_norm: squares summed in double, one float scale; SiLU: x / (1 + v_expf(-x));
- RoPE: angles by the float recurrence theta *= theta_scale, the C library's sinf/cosf, and the
  rotation compiled with the first product of each line fused (fma).

Slow (every matmul is a loop of lane sums and emulated fmas): meant for checking the model against
llama.cpp, not for chatting with large models. Axis letters: engine/__init__.py (a matmul: Z summed, O outputs).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ....errors import ModelError
from ...gguf import kernels
from ...rope import RopeParams, yarn_corr_dims

F32, F64 = np.float32, np.float64
LANES = 16  # AVX-512 float lanes (tinyBLAS KN, ggml_vec_dot_f32 EPR)


def fma(a, b, c) -> np.ndarray:
    """a * b + c with one float32 rounding: the product is exact in float64 (converted as the ufuncs read)."""
    return np.add(np.multiply(a, b, dtype=F64), c, dtype=F64).astype(F32)


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
    """The C library's expf, elementwise (correctly rounded float64 where there is no C library)."""
    x = np.asarray(x, F32)
    lib = _libm()
    if lib is None:
        with np.errstate(over="ignore"):
            return np.exp(x.astype(F64)).astype(F32)
    return np.array([lib.expf(v) for v in x.reshape(-1).tolist()], dtype=F32).reshape(x.shape)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_0 / q8_1 on rows of x (T, Z): int8 values (T, Z/32, 32), fp16 scales d as
    f32 (T, Z/32), and q8_1's block sums s = fp16(d * sum q) with d before its rounding (T, Z/32)."""
    b = np.ascontiguousarray(x, dtype=F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)  # (T, Z/32, 1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((b * inv).astype(F32)).astype(np.int8)  # round half to even (_mm256_round_ps)
    d = (amax[..., 0] / F32(127)).astype(F32)
    s = (d * q.sum(axis=-1, dtype=np.int32).astype(F32)).astype(np.float16).astype(F32)
    return q, d.astype(np.float16).astype(F32), s


class GgmlWeight:
    """A matmul weight as the GGUF stores it, multiplied as ggml does (x (T, Z) -> (T, O)):
    F32 (f (O, Z)), Q8_0 (q int8 (O, Z/32, 32), d (O, Z/32)), Q4_1 (q 0..15, d, and minimums m), or one
    of INT8_KINDS (rows (O, row bytes), the file's blocks)."""

    def __init__(self, kind: str, q=None, d=None, m=None, f=None, rows=None):
        self.kind, self.q, self.d, self.m, self.f, self.rows = kind, q, d, m, f, rows

    def __call__(self, x: np.ndarray, no_sgemm: bool = False) -> np.ndarray:
        """no_sgemm: in llama.cpp's graph x is a permuted view, or the op is ggml_mul_mat_id (routed
        experts); neither goes through tinyBLAS, so f32 weights take ggml_vec_dot_f32's order.
        (tinyBLAS_Q0 and vec_dot_q8_0 sum in the same order; Q4_1 has no tinyBLAS form.)"""
        if self.kind == "F32":
            return vec_dot_f32(x, self.f) if no_sgemm else matmul_f32(x, self.f)
        if self.kind in INT8_KINDS:
            return int8_products(x, self)
        return matmul_blocks(x, self)


# Bit for bit: the weight types these numerics multiply in llama.cpp's order
KINDS = ("F32", "Q8_0", "Q4_1")
# Within a bound: the K-quants and IQ4_XS, through the compiled kernels' integer products on x rounded to Q8_K as
# ggml rounds it (the same integers; the last float sums in another order: llama.cpp's decode logits within
# 1e-6 of the largest, tests/test_quant_types.py); Q2_K, Q6_K and IQ4_NL (llama.cpp multiplies them with other
# kernels where a matrix's rows are a multiple of 8, and rounds x to Q8_0 with fp16 scales for IQ4_NL): within
# 3% of the largest logit.
INT8_KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}


def require_kinds(t, names) -> None:
    """Refuse, naming the tensor, a matmul weight these numerics cannot multiply as llama.cpp does (INT8_KINDS
    need the compiled kernels)."""
    problem = kernels.problem()
    for name in names:
        kind = t.qtype(name).name
        if kind in INT8_KINDS and problem is not None:
            raise ModelError(f"{t.path}: llama.cpp numerics multiply {kind} weights ({name}) with the compiled "
                             f"kernels, which cannot run here ({problem}); use the default numerics")
        if kind not in KINDS + INT8_KINDS:
            raise ModelError(f"{t.path}: llama.cpp numerics support {', '.join(KINDS + INT8_KINDS)} weights, "
                             f"not {kind} ({name}); use the default numerics")


def read_weight(t, name: str, expert: int | None = None, head: int | None = None) -> GgmlWeight:
    """One weight of Tensors `t` (one expert of a *_exps tensor, one head of a 3-D tensor)."""
    kind = t.qtype(name).name
    if kind == "F32":
        f = t.f32(name, expert)
        return GgmlWeight(kind, f=f if head is None else f[head])
    data = t.require(name).data
    data = data if expert is None else data[expert]
    if kind in INT8_KINDS:
        rows = np.asarray(data, dtype=np.uint8)
        rows = rows.reshape(-1, rows.shape[-1]) if head is None else rows[head]  # (O, row bytes)
        return GgmlWeight(kind, rows=rows)
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, _BLOCK_BYTES[kind])  # (blocks, bytes)
    shape = t.shape(name)[0 if expert is None else 1:-1] + (-1,)  # (..., O, Z/32)
    d = blocks[:, 0:2].copy().view(np.float16).astype(F32).reshape(shape)
    m = None
    if kind == "Q8_0":  # fp16 d, 32 int8
        q = blocks[:, 2:].view(np.int8).reshape(shape + (32,))  # a view of the memory-mapped file
    else:  # Q4_1: fp16 d, fp16 m, 16 bytes: element j in the low nibble of byte j, j + 16 in the high one
        m = blocks[:, 2:4].copy().view(np.float16).astype(F32).reshape(shape)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int8).reshape(shape + (32,))
    if head is not None:
        q, d, m = q[head], d[head], None if m is None else m[head]
    return GgmlWeight(kind, q, d, m)


def matmul_blocks(x: np.ndarray, w: GgmlWeight, rows: int = 16) -> np.ndarray:
    """x (T, Z) times a Q8_0 or Q4_1 weight -> (T, O), as ggml_vec_dot_q8_0_q8_0 / q4_1_q8_1 sum
    it: activations quantized per 32 (Q8_0, or Q8_1 with s = d * sum q); per block 8 lanes of 4
    integer products, scaled by d_w * d_x and accumulated with fma over the blocks; hsum. Q4_1
    adds the sum over blocks of m_w * s_x (fma), after the hsum."""
    xq, xd, xs = quantize_q8_0(x)
    t, nb = xd.shape
    n = w.q.shape[0]
    wl = w.q.reshape(n, nb, 8, 4).transpose(1, 2, 3, 0).astype(F32)  # (nb, 8, 4, O)
    out = np.empty((t, n), dtype=F32)
    for i0 in range(0, t, rows):
        xl = xq[i0:i0 + rows].reshape(-1, nb, 8, 4).transpose(1, 2, 0, 3).astype(F32)  # (nb, 8, t, 4)
        acc = np.zeros((xl.shape[2], n, 8), dtype=F32)  # (t, O, 8)
        summs = np.zeros((xl.shape[2], n), dtype=F32)  # (t, O)
        for blk in range(nb):
            lanes = np.matmul(xl[blk], wl[blk]).transpose(1, 2, 0)  # (t, O, 8), exact: |sum| < 2^24
            dd = (w.d[None, :, blk] * xd[i0:i0 + rows, blk, None]).astype(F32)  # (t, O)
            acc = fma(dd[..., None], lanes, acc)
            if w.m is not None:
                summs = fma(w.m[None, :, blk], xs[i0:i0 + rows, blk, None], summs)
        out[i0:i0 + rows] = (hsum(acc) + summs).astype(F32) if w.m is not None else hsum(acc)
    return out


def int8_products(x: np.ndarray, w: GgmlWeight) -> np.ndarray:
    """x (T, Z) times a weight of INT8_KINDS -> (T, O): the kernels' products (kernels.matvec), SMALL_BATCH
    rows of x at a time (their bits do not depend on how many)."""
    x = np.ascontiguousarray(x, dtype=F32)
    out = np.empty((x.shape[0], w.rows.shape[0]), dtype=F32)
    for i in range(0, x.shape[0], kernels.SMALL_BATCH):
        kernels.matvec(w.kind, w.rows, x[i : i + kernels.SMALL_BATCH], out[i : i + kernels.SMALL_BATCH])
    return out


def vec_dot_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 for every row pair: x (T, Z), w (O, Z) -> (T, O). Four accumulators of 16
    lanes over 64-wide steps (fma), combined (a0 + a2) + (a1 + a3), hsum; then a scalar tail."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    k = x.shape[1]
    step = 4 * LANES
    body = k - k % step
    acc = [np.zeros((x.shape[0], w.shape[0], LANES), dtype=F32) for _ in range(4)]  # 4 x (T, O, 16)
    for l0 in range(0, body, step):
        for j in range(4):
            s = slice(l0 + j * LANES, l0 + (j + 1) * LANES)
            acc[j] = fma(x[:, None, s], w[None, :, s], acc[j])
    out = hsum(((acc[0] + acc[2]).astype(F32) + (acc[1] + acc[3]).astype(F32)).astype(F32))
    for i in range(body, k):
        out = (out + (x[:, None, i] * w[None, :, i]).astype(F32)).astype(F32)
    return out


def matmul_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """ggml_mul_mat of contiguous f32 operands: x (T, Z) times w (O, Z) -> (T, O). tinyBLAS (16
    lanes accumulated with fma along Z, then hsum) when T >= 2 and Z is a multiple of 16, else
    ggml_vec_dot_f32 (tinyBLAS refuses a single column)."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    k = x.shape[1]
    if x.shape[0] < 2 or k % LANES:
        return vec_dot_f32(x, w)
    acc = np.zeros((x.shape[0], w.shape[0], LANES), dtype=F32)  # (T, O, 16)
    for l0 in range(0, k, LANES):
        acc = fma(x[:, None, l0:l0 + LANES], w[None, :, l0:l0 + LANES], acc)
    return hsum(acc)


def attention_head(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, scale) -> np.ndarray:
    """One head of llama.cpp's attention (flash attention off, f32 cache): q (T, Z), keys (N, Z),
    values (N, C), mask (T, N) of 0 / -inf -> (T, C).

    KQ: q is a permuted (non-contiguous) view in llama.cpp's graph, so ggml_vec_dot_f32 runs, not
    tinyBLAS. soft_max with the scale. KQV over the cache length padded to 256 (zero weights beyond
    the last key change no sum), by matmul_f32's rule."""
    pad = (-keys.shape[0]) % 256
    kq = vec_dot_f32(q, keys)  # (T, N)
    s = np.pad(((kq * F32(scale)).astype(F32) + mask).astype(F32), ((0, 0), (0, pad)), constant_values=-np.inf)
    return matmul_f32(soft_max(s), np.pad(values, ((0, pad), (0, 0))).T)  # (T, N + pad) @ (N + pad, C)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm then the weight multiply: squares (float) summed in double in order."""
    x = np.asarray(x, F32)
    total = np.cumsum((x * x).astype(F64), axis=-1)[..., -1:]  # sequential double sum
    mean = (total / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return ((x * scale).astype(F32) * weight).astype(F32)


def soft_max(s: np.ndarray) -> np.ndarray:
    """ggml_soft_max on rows (already scaled and masked with -inf): ggml_v_expf on each 16-wide
    chunk, summed in float (hsum), the chunk sums added in double; the last n % 16 entries by the C
    library's expf, added in double one by one; then one float 1/sum."""
    x = (s - s.max(axis=-1, keepdims=True)).astype(F32)  # (..., N)
    body = x.shape[-1] - x.shape[-1] % LANES
    e = np.concatenate([v_expf(x[..., :body]), expf(x[..., body:])], axis=-1)
    chunks = hsum(e[..., :body].reshape(e.shape[:-1] + (-1, LANES))).astype(F64)  # (..., N / 16)
    total = np.cumsum(np.concatenate([chunks, e[..., body:].astype(F64)], axis=-1), axis=-1)[..., -1:]
    return (e * (1.0 / total).astype(F32)).astype(F32)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32: x / (1 + v_expf(-x)) * g."""
    e = v_expf((F32(0) - gate).astype(F32))
    return ((gate / (F32(1) + e).astype(F32)).astype(F32) * up).astype(F32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml_vec_sigmoid_f32: 1 / (1 + expf(-x))."""
    return (F32(1) / (F32(1) + expf(-np.asarray(x, F32))).astype(F32)).astype(F32)


@functools.lru_cache(maxsize=1)
def _libm():
    """The C library's sinf, cosf, expf and powf (what ggml calls outside its SIMD code), or None
    where it cannot be loaded."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    except OSError:
        return None
    for name, n_args in (("sinf", 1), ("cosf", 1), ("expf", 1), ("powf", 2)):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float] * n_args
    return lib


def _sincos(angle: np.ndarray, lib) -> tuple[np.ndarray, np.ndarray]:
    """sinf and cosf of a float32 array (the C library's; correctly rounded float64 where there is none)."""
    if lib is None:
        return np.sin(angle.astype(F64)).astype(F32), np.cos(angle.astype(F64)).astype(F32)
    values = angle.tolist()
    return (np.array([lib.sinf(v) for v in values], dtype=F32), np.array([lib.cosf(v) for v in values], dtype=F32))


def rope_cache(p: RopeParams, n_pos: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """ggml_rope_cache_init for positions 0..n_pos-1: cos, sin (P, I) float32, magnitude folded in.
    Angles by the float recurrence theta *= theta_scale from theta = p; the YaRN blend with the
    first product fused (GCC contracts it); sinf/cosf from the C library."""
    lib = _libm()
    i_pairs = p.n_dims // 2
    if lib is not None:
        theta_scale = F32(lib.powf(float(F32(p.base)), float(F32(-2.0) / F32(p.n_dims))))
    else:
        theta_scale = F32(float(F32(p.base)) ** (-2.0 / p.n_dims))
    fs = F32(p.freq_scale)
    mscale = F32(p.attn_factor)
    low = high = 0.0
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p)
        ln = F32(math.log(float(F32(1) / fs)))  # logf(1 / freq_scale)
        mscale = F32(mscale * fma(F32(0.1), ln, F32(1)))
    cos = np.empty((n_pos, i_pairs), dtype=F32)
    sin = np.empty((n_pos, i_pairs), dtype=F32)
    theta = np.arange(n_pos, dtype=F32)  # theta_base = p, per position
    for i in range(i_pairs):
        extrap = theta if freq_factors is None else (theta / F32(freq_factors[i])).astype(F32)
        angle = (fs * extrap).astype(F32)  # theta_interp
        if p.ext_factor != 0.0:
            y = F32(F32(i - low) / F32(max(0.001, high - low)))
            mix = F32(F32(1) - F32(min(1.0, max(0.0, float(y))))) * F32(p.ext_factor)
            angle = fma(angle, F32(1) - mix, (extrap * mix).astype(F32))
        sin[:, i], cos[:, i] = _sincos(angle, lib)
        theta = (theta * theta_scale).astype(F32)
    return (cos * mscale).astype(F32), (sin * mscale).astype(F32)


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs of x (T, ..., 2I) by the (T, I) tables as compiled in ggml (the first
    product of each line fused): (fma(x0, c, -x1 s), fma(x0, s, x1 c))."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty(x.shape, dtype=F32)
    out[..., 0::2] = fma(x0, c, -(x1 * s).astype(F32))
    out[..., 1::2] = fma(x0, s, (x1 * c).astype(F32))
    return out
