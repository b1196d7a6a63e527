"""Q8_0's and the K-quants' matvec on int8 activations (llama.cpp's way): x rounded to 8 bits, integer dots.

Types (kernels.INT8_ACTIVATIONS): Q4_K and Q6_K against x rounded to Q8_K (ggml's quantize_row_q8_K: per
256 values, d = max / -127 for the value of largest magnitude, qx the nearest integer of x / d, even on
ties, and the sums of qx over each 16), Q8_0 against x rounded to Q8_0 (per 32 values: qx the nearest
integer of x 127 / max |x|, d = max |x| / 127, kept in float32 where llama.cpp keeps fp16). A block's
sub-block of 32 (or 16) codes is dotted with qx in int32, exactly; the sub-block's integer scale is applied
to that sum, a minimum through the sums of qx (Q8_0's signed codes: + 128, less 128 sum qx); per block,
dx d sum is added in float64.

The dot products are the compiled code's own: numba intrinsics (q8_0_dot, q4_k_dots, q6_k_dots) emit
LLVM vector IR for a block: its codes unpacked in byte lanes, 32 codes (unsigned) times 32 int8 of qx
summed into int32 lanes, each sub-block's lanes times its scale, one horizontal sum. On a CPU with int8
dot products (AVX-512 VNNI or AVX-VNNI) each 32 codes are one vpdpbusd; elsewhere portable IR (widen to
int16, multiply, widen) that LLVM lowers for the CPU numba compiles for. numba keys its cache by the CPU,
so a cache is never run on the wrong one.

Accuracy: exact integers, so the only error beside float rounding is x's rounding: |x - dx qx| <= |dx| / 2,
so |out - x W.T| <= sum over x's blocks of |dx| / 2 sum |W| + 1e-5 sum |x| |W| (tests/test_kernels.py):
about 1% of the largest logit on the tiny models, the error llama.cpp's CPU backend has.
Measured against the float32 activations of kernel_bodies.py / kernel_kquants.py (benchmarks/kernels.py,
14336 x 4096, a thread, this 2-core Zen 4 with AVX-512 VNNI): Q4_K 7.8 -> 14-15 Gparam/s, Q6_K 3.3 -> 8-14,
Q8_0 4.6 -> 10.

Bits: each out[t, r] is a function of w[r] and x[t] alone (x[t]'s rounding is too), summed in a fixed
order: the same for any T, row split or thread count.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic

from .kernel_bodies import F32, F64, _f16
from .kernel_kquants import _scale_min_k4

FLT_MAX = np.finfo(np.float32).max
I8x32 = ir.VectorType(ir.IntType(8), 32)
I32 = ir.IntType(32)


def _vnni() -> bool:
    """Whether the code numba compiles is for this CPU (numba's default) and it has vpdpbusd."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    features = binding.get_host_cpu_features()
    return bool(features.get("avxvnni") or (features.get("avx512vnni") and features.get("avx512vl")))


class _IR:
    """The vector IR of one intrinsic's body: loads from numba arrays, integer dots, sums."""

    def __init__(self, context, builder, signature, args):
        self.context, self.b, self.types, self.args = context, builder, signature.args, args

    def load(self, arg: int, offset: int, at: int = 1, n: int = 32):
        """<n x i8>: the n bytes from index args[at] + offset of the (C-contiguous) int8/uint8 array args[arg]."""
        data = self.context.make_array(self.types[arg])(self.context, self.b, self.args[arg]).data
        index = self.b.add(self.args[at], ir.Constant(self.args[at].type, offset))
        vector = ir.VectorType(ir.IntType(8), n)
        return self.b.load(self.b.bitcast(self.b.gep(data, [index]), vector.as_pointer()), align=1)

    @staticmethod
    def bytes(v: int):
        return ir.Constant(I8x32, [v] * 32)

    def function(self, name, result, args):
        module = self.b.module
        return module.globals.get(name) or ir.Function(module, ir.FunctionType(result, args), name)

    def dot_lanes(self, codes, xv):
        """codes <32 x i8> unsigned times xv signed, as int32 lanes whose sum is the dot product: 8 lanes
        from vpdpbusd (lane k: values 4 k .. 4 k + 3), else the 32 products."""
        if _vnni():
            v8 = ir.VectorType(I32, 8)
            dp = self.function("llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8])
            return self.b.call(dp, [ir.Constant(v8, None), self.b.bitcast(codes, v8), self.b.bitcast(xv, v8)])
        v16 = ir.VectorType(ir.IntType(16), 32)  # |code qx| <= 255 * 128 fits int16
        return self.b.sext(self.b.mul(self.b.zext(codes, v16), self.b.sext(xv, v16)), ir.VectorType(I32, 32))

    def scaled(self, lanes, scales, first: int, second: int):
        """lanes times scale `first` in the lanes of values 0-15, scale `second` in those of 16-31 (scales:
        an int32 vector)."""
        n = lanes.type.count
        pick = ir.Constant(ir.VectorType(I32, n), [first] * (n // 2) + [second] * (n // 2))
        return self.b.mul(lanes, self.b.shuffle_vector(scales, scales, pick))

    def total(self, vectors):
        """The int32 sum of every lane of the int32 vectors."""
        v = vectors[0]
        for u in vectors[1:]:
            v = self.b.add(v, u)
        reduce = self.function(f"llvm.vector.reduce.add.v{v.type.count}i32", I32, [v.type])
        return self.b.call(reduce, [v])


def _c_layout(*arrays) -> bool:
    return all(a.layout == "C" for a in arrays)  # (the bytes are read as one run from the first)


@intrinsic
def q8_0_dot(typingctx, w, o, qx, xo):
    """(the 32 int8 codes of the Q8_0 block at byte o, + 128) . qx[xo:xo + 32], int32: the codes made
    unsigned for vpdpbusd (the caller takes 128 sum qx off)."""
    if not _c_layout(w, qx):
        return None

    def codegen(context, builder, signature, args):
        ir_ = _IR(context, builder, signature, args)
        codes = builder.xor(ir_.load(0, 2), ir_.bytes(128))
        return ir_.total([ir_.dot_lanes(codes, ir_.load(2, 0, at=3))])

    return types.int32(w, o, qx, xo), codegen


@intrinsic
def q4_k_dots(typingctx, w, o, qx, xo, sc):
    """sum over the 8 sub-blocks j of the Q4_K block at byte o of sc[j] (its codes . qx[xo + 32 j:][:32]),
    int32: the products summed and scaled in int32 lanes, one horizontal sum a block."""
    if not _c_layout(w, qx, sc):
        return None

    def codegen(context, builder, signature, args):
        ir_ = _IR(context, builder, signature, args)
        data = context.make_array(signature.args[4])(context, builder, args[4]).data
        scales = builder.load(builder.bitcast(data, ir.VectorType(I32, 8).as_pointer()), align=4)
        parts = []
        for c in range(4):  # 32 bytes: sub-block 2 c in the low nibbles, 2 c + 1 in the high ones
            nibbles = ir_.load(0, 16 + 32 * c)
            low, high = builder.and_(nibbles, ir_.bytes(15)), builder.lshr(nibbles, ir_.bytes(4))
            for j, codes in ((2 * c, low), (2 * c + 1, high)):
                parts.append(ir_.scaled(ir_.dot_lanes(codes, ir_.load(2, 32 * j, at=3)), scales, j, j))
        return ir_.total(parts)

    return types.int32(w, o, qx, xo, sc), codegen


@intrinsic
def q6_k_dots(typingctx, w, o, qx, xo):
    """sum over the 16 sub-blocks i of the Q6_K block at byte o of its int8 scale i times (its codes, 0-63
    before the less 32, . qx[xo + 16 i:][:16]), int32 (the caller takes 32 sum_i scale_i sum qx off)."""
    if not _c_layout(w, qx):
        return None

    def codegen(context, builder, signature, args):
        ir_ = _IR(context, builder, signature, args)
        scales = builder.sext(ir_.load(0, 192, n=16), ir.VectorType(I32, 16))
        parts = []
        for h in range(2):
            for g in range(4):  # values 128 h + 32 g + l: sub-blocks 8 h + 2 g and 8 h + 2 g + 1
                low = builder.and_(builder.lshr(ir_.load(0, 64 * h + 32 * (g & 1)), ir_.bytes(4 * (g >> 1))),
                                   ir_.bytes(15))
                high = builder.and_(builder.lshr(ir_.load(0, 128 + 32 * h), ir_.bytes(2 * g)), ir_.bytes(3))
                codes = builder.or_(low, builder.shl(high, ir_.bytes(4)))
                lanes = ir_.dot_lanes(codes, ir_.load(2, 128 * h + 32 * g, at=3))
                parts.append(ir_.scaled(lanes, scales, 8 * h + 2 * g, 8 * h + 2 * g + 1))
        return ir_.total(parts)

    return types.int32(w, o, qx, xo), codegen


@njit
def quantize_q8_k(x, qx, dx, bsums):
    """x (T, Z) float32 -> qx (T, Z) int8, dx (T, Z / 256) float32, bsums (T, Z / 16) int32: ggml's
    quantize_row_q8_K (float32 arithmetic, no fastmath: its bits)."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 256):
            o, amax, top, finite = 256 * b, F32(0), F32(0), True
            for j in range(256):
                a = abs(x[t, o + j])
                finite &= a <= FLT_MAX  # (NaN and inf: not)
                if a > amax:
                    amax, top = a, x[t, o + j]
            if amax == 0 or not finite:  # (a NaN or inf in x: the products with this block are NaN)
                dx[t, b] = 0 if finite else np.nan
                qx[t, o : o + 256] = 0
                bsums[t, 16 * b : 16 * b + 16] = 0
                continue
            iscale = F32(-127) / top
            for j in range(256):
                qx[t, o + j] = min(127, np.int32(np.rint(iscale * x[t, o + j])))
            for j in range(16):
                s = 0
                for k in range(16):
                    s += np.int32(qx[t, o + 16 * j + k])
                bsums[t, 16 * b + j] = s
            dx[t, b] = F32(1) / iscale


@njit
def q8_k(x):
    """(qx, dx, bsums) of x: quantize_q8_k into new arrays."""
    T, Z = x.shape
    qx, dx, bsums = np.empty((T, Z), np.int8), np.empty((T, Z // 256), F32), np.empty((T, Z // 16), np.int32)
    quantize_q8_k(x, qx, dx, bsums)
    return qx, dx, bsums


@njit
def q8_0(x):
    """(qx (T, Z) int8, dx (T, Z / 32) float32, xsum (T, Z / 32) int32 the sums of qx) of x: llama.cpp's
    Q8_0 rounding of activations on x86 (per 32 values: qx the nearest integer of x 127 / max |x|, even on
    ties), the scale d = max |x| / 127 kept in float32 (llama.cpp rounds it to fp16)."""
    T, Z = x.shape
    qx, dx, xsum = np.empty((T, Z), np.int8), np.empty((T, Z // 32), F32), np.empty((T, Z // 32), np.int32)
    for t in range(T):
        for b in range(Z // 32):
            amax, finite = F32(0), True
            for j in range(32):
                a = abs(x[t, 32 * b + j])
                finite &= a <= FLT_MAX
                amax = max(amax, a)
            inv = F32(127) / amax if amax != 0 and finite else F32(0)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[t, 32 * b + j] * inv))
                qx[t, 32 * b + j] = q
                s += q
            dx[t, b], xsum[t, b] = amax / F32(127) if finite else np.nan, s
    return qx, dx, xsum


@njit
def _row_q8_0(wr, qx, dx, xsum):
    acc = 0.0
    for b in range(qx.shape[0] // 32):
        o = 34 * b
        acc += F64(dx[b]) * F64(_f16(wr[o], wr[o + 1])) * F64(q8_0_dot(wr, o, qx, 32 * b) - 128 * xsum[b])
    return acc


@njit
def _row_q4_k(wr, qx, dx, bsums, sc):
    acc = 0.0
    for b in range(qx.shape[0] // 256):
        o, xo = 144 * b, 256 * b
        sum_m = 0
        for j in range(8):
            sc[j], m = _scale_min_k4(wr, o + 4, j)
            sum_m += m * np.int64(bsums[16 * b + 2 * j] + bsums[16 * b + 2 * j + 1])
        sum_i = q4_k_dots(wr, o, qx, xo, sc)
        d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
        acc += F64(dx[b]) * (d * F64(sum_i) - dmin * F64(sum_m))
    return acc


@njit
def _row_q6_k(wr, qx, dx, bsums):
    acc = 0.0
    for b in range(qx.shape[0] // 256):
        o, xo = 210 * b, 256 * b
        offset = 0  # the codes less 32: 32 sum_i scale_i (the sum of qx over sub-block i)
        for i in range(16):
            offset += np.int32(np.int8(wr[o + 192 + i])) * bsums[16 * b + i]
        sum_i = np.int64(q6_k_dots(wr, o, qx, xo)) - 32 * np.int64(offset)
        acc += F64(dx[b]) * F64(_f16(wr[o + 208], wr[o + 209])) * F64(sum_i)
    return acc


def matvec_q8_0(w, x, out):
    qx, dx, xsum = q8_0(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q8_0(w[r], qx[t], dx[t], xsum[t])


def matvec_q4_k(w, x, out):
    qx, dx, bsums = q8_k(x)
    sc = np.empty(8, np.int32)  # a block's sub-block scales
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q4_k(w[r], qx[t], dx[t], bsums[t], sc)


def matvec_q6_k(w, x, out):
    qx, dx, bsums = q8_k(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q6_k(w[r], qx[t], dx[t], bsums[t])
