"""Q8_0's and the K-quants' matvec on int8 activations (llama.cpp's way): x rounded to 8 bits, integer dots.

Types (kernels.INT8_ACTIVATIONS): Q4_K, Q5_K and Q6_K against x rounded to Q8_K (ggml's quantize_row_q8_K: per
256 values, d = max / -127 for the value of largest magnitude, qx the nearest integer of x / d, even on
ties, and the sums of qx over each 16), Q8_0 against x rounded to Q8_0 (per 32 values: qx the nearest
integer of x 127 / max |x|, d = max |x| / 127, kept in float32 where llama.cpp keeps fp16). A block's
sub-block of 32 (or 16) codes is dotted with qx in int32, exactly. K-quants: the sub-blocks' integer
scales are applied to those sums in int32 lanes, a minimum through the sums of qx, and dx d sum is added
per block in float64. Q8_0 (signed codes: |code| times qx with the code's sign): a block's 8 int32 lanes
times d dx are added into 8 float32 lanes along the row, summed in order at its end.

The dot products are the compiled code's own: numba intrinsics (q8_0_row, q4_k_sums / q5_k_sums, q6_k_sum) emit
LLVM vector IR for a block (Q8_0: a row): its codes unpacked in byte lanes, 32 codes (unsigned) times 32 int8 of qx
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

    def load(self, arg: int, offset: int, at: int = 1, n: int = 32, bits: int = 8):
        """<n x i`bits`>: the n values from index args[at] + offset of the (C-contiguous) array args[arg]
        (of int8/uint8, or int32 for bits 32)."""
        return self.load_at(arg, self.b.add(self.args[at], ir.Constant(self.args[at].type, offset)), n, bits)

    def load_at(self, arg: int, index, n: int = 32, bits: int = 8):
        """As load, from the index (an IR integer); n 1: the scalar."""
        data = self.context.make_array(self.types[arg])(self.context, self.b, self.args[arg]).data
        kind = ir.IntType(bits) if n == 1 else ir.VectorType(ir.IntType(bits), n)
        return self.b.load(self.b.bitcast(self.b.gep(data, [index]), kind.as_pointer()), align=1)

    def lanes(self, v, picks):
        """The int vector of v's lanes `picks`."""
        return self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(picks)), picks))

    def join(self, a, b, n: int):
        """Lanes 0 .. n/2 - 1 of a, then n/2 .. n - 1 of b (both n lanes)."""
        picks = list(range(n // 2)) + list(range(n + n // 2, 2 * n))
        return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, n), picks))

    def ints(self, v: int, n: int = 8):
        return ir.Constant(ir.VectorType(I32, n), [v] * n)

    @staticmethod
    def bytes(v: int):
        return ir.Constant(I8x32, [v] * 32)

    def function(self, name, result, args):
        module = self.b.module
        return module.globals.get(name) or ir.Function(module, ir.FunctionType(result, args), name)

    def dot_lanes(self, codes, xv):
        """codes <32 x i8> unsigned times xv signed, summed in 8 int32 lanes (lane k: values 4 k .. 4 k + 3):
        vpdpbusd, or portable IR giving the same lanes (the products widened, each 4 added)."""
        v8 = ir.VectorType(I32, 8)
        if _vnni():
            dp = self.function("llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8])
            return self.b.call(dp, [ir.Constant(v8, None), self.b.bitcast(codes, v8), self.b.bitcast(xv, v8)])
        v16 = ir.VectorType(ir.IntType(16), 32)  # |code qx| <= 255 * 128 fits int16
        p = self.b.sext(self.b.mul(self.b.zext(codes, v16), self.b.sext(xv, v16)), ir.VectorType(I32, 32))
        fours = [self.lanes(p, list(range(i, 32, 4))) for i in range(4)]
        return self.b.add(self.b.add(fours[0], fours[1]), self.b.add(fours[2], fours[3]))

    def half(self, h):
        """The float32 of the fp16 bits h (i16), in integer and exact float steps: (m + 1024 if e else m)
        2^(max(e, 1) - 25), inf or NaN for e = 31, the sign bit on top (no F16C, no library call)."""
        b, i32 = self.b, I32
        u = b.zext(h, i32)
        e, m = b.and_(b.lshr(u, ir.Constant(i32, 10)), ir.Constant(i32, 31)), b.and_(u, ir.Constant(i32, 1023))
        normal = b.icmp_unsigned("!=", e, ir.Constant(i32, 0))
        mant = b.select(normal, b.or_(m, ir.Constant(i32, 1024)), m)
        power = b.shl(b.add(b.select(normal, e, ir.Constant(i32, 1)), ir.Constant(i32, 102)), ir.Constant(i32, 23))
        value = b.bitcast(b.fmul(b.sitofp(mant, ir.FloatType()), b.bitcast(power, ir.FloatType())), i32)
        special = b.or_(ir.Constant(i32, 0x7F800000), b.shl(m, ir.Constant(i32, 13)))  # inf, or a NaN
        bits = b.select(b.icmp_unsigned("==", e, ir.Constant(i32, 31)), special, value)
        return b.bitcast(b.or_(bits, b.shl(b.and_(u, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))), ir.FloatType())

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
def q8_0_row(typingctx, w, qx, dx, blocks):
    """The dot product of a row of `blocks` Q8_0 blocks with qx (int8, dx the scales of its runs of 32),
    float32: each block's codes (as |code| and qx with the code's sign: unsigned times signed) dotted in 8
    int32 lanes, the lanes times the block's two scales added into 8 float32 lanes, those summed in order."""
    if not _c_layout(w, qx, dx):
        return None

    def codegen(context, builder, signature, args):
        ir_ = _IR(context, builder, signature, args)
        f32, i64, v8f = ir.FloatType(), ir.IntType(64), ir.VectorType(ir.FloatType(), 8)
        zero = ir.Constant(i64, 0)
        start = builder.block
        loop, done = builder.append_basic_block("q8_0.loop"), builder.append_basic_block("q8_0.done")
        builder.cbranch(builder.icmp_signed(">", args[3], zero), loop, done)
        builder.position_at_end(loop)
        b, acc = builder.phi(i64), builder.phi(v8f)
        o = builder.mul(b, ir.Constant(i64, 34))
        d = ir_.half(ir_.load_at(0, o, n=1, bits=16))
        codes = ir_.load_at(0, builder.add(o, ir.Constant(i64, 2)))
        xv = ir_.load_at(1, builder.mul(b, ir.Constant(i64, 32)))
        negative = builder.icmp_signed("<", codes, ir.Constant(I8x32, None))
        magnitude = builder.select(negative, builder.neg(codes), codes)  # (-128: 128 as unsigned)
        signed_x = builder.select(negative, builder.neg(xv), xv)  # (|qx| <= 127)
        lanes = builder.sitofp(ir_.dot_lanes(magnitude, signed_x), v8f)
        dx = context.make_array(signature.args[2])(context, builder, args[2]).data
        scale = builder.fmul(d, builder.load(builder.gep(dx, [b])))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v8f, None), scale, ir.Constant(I32, 0)),
                                       ir.Constant(v8f, None), ir.Constant(ir.VectorType(I32, 8), [0] * 8))
        after = builder.fadd(acc, builder.fmul(lanes, splat))
        following = builder.add(b, ir.Constant(i64, 1))
        b.add_incoming(zero, start)
        b.add_incoming(following, loop)
        acc.add_incoming(ir.Constant(v8f, None), start)
        acc.add_incoming(after, loop)
        builder.cbranch(builder.icmp_signed("<", following, args[3]), loop, done)
        builder.position_at_end(done)
        total = builder.phi(v8f)
        total.add_incoming(ir.Constant(v8f, None), start)
        total.add_incoming(after, loop)
        reduce = ir_.function("llvm.vector.reduce.fadd.v8f32", f32, [f32, v8f])
        return builder.call(reduce, [ir.Constant(f32, -0.0), total])  # (no reassoc flag: lane 0 first, in order)

    return types.float32(w, qx, dx, blocks), codegen


def _k4_sums(fifth: bool):
    """The intrinsic of Q4_K's blocks (fifth False) or Q5_K's (True: 32 bytes qh at byte 16 before the
    nibbles, bit j of qh[l] the fifth bit of value l of sub-block j)."""

    @intrinsic
    def sums(typingctx, w, o, qx, xo, bsums, bo):
        """(sum_j sc_j (sub-block j's codes . qx[xo + 32 j:][:32]), sum_j m_j (bsums[bo + 2 j] + bsums[bo +
        2 j + 1])) of the block at byte o, int32: its six-bit scales sc and minimums m unpacked in lanes."""
        if not _c_layout(w, qx, bsums):
            return None

        def codegen(context, builder, signature, args):
            ir_ = _IR(context, builder, signature, args)
            b = builder.zext(ir_.load(0, 4, n=16), ir.VectorType(I32, 16))  # the 12 scale bytes (and 4 more)
            # sc_j: byte j & 63 (j < 4), else byte j + 4 & 15 | (byte j - 4 >> 6) << 4
            # m_j: byte j + 4 & 63 (j < 4), else byte j + 4 >> 4 | (byte j >> 6) << 4
            first = ir_.lanes(b, [0, 1, 2, 3, 8, 9, 10, 11])
            second = ir_.lanes(b, [4, 5, 6, 7, 8, 9, 10, 11])
            top_sc = builder.shl(builder.lshr(ir_.lanes(b, [0, 1, 2, 3, 0, 1, 2, 3]), ir_.ints(6)), ir_.ints(4))
            top_m = builder.shl(builder.lshr(ir_.lanes(b, [0, 1, 2, 3, 4, 5, 6, 7]), ir_.ints(6)), ir_.ints(4))
            and_, or_ = builder.and_, builder.or_
            scales = ir_.join(and_(first, ir_.ints(63)), or_(and_(first, ir_.ints(15)), top_sc), 8)
            mins = ir_.join(and_(second, ir_.ints(63)), or_(builder.lshr(second, ir_.ints(4)), top_m), 8)
            high_bits = ir_.load(0, 16) if fifth else None
            parts = []
            for c in range(4):  # 32 bytes: sub-block 2 c in the low nibbles, 2 c + 1 in the high ones
                nibbles = ir_.load(0, (48 if fifth else 16) + 32 * c)
                low, high = builder.and_(nibbles, ir_.bytes(15)), builder.lshr(nibbles, ir_.bytes(4))
                for j, codes in ((2 * c, low), (2 * c + 1, high)):
                    if fifth:
                        bit = builder.and_(builder.lshr(high_bits, ir_.bytes(j)), ir_.bytes(1))
                        codes = builder.or_(codes, builder.shl(bit, ir_.bytes(4)))
                    parts.append(ir_.scaled(ir_.dot_lanes(codes, ir_.load(2, 32 * j, at=3)), scales, j, j))
            runs = ir_.load(4, 0, at=5, n=16, bits=32)  # the sums of qx over each 16
            pairs = builder.add(ir_.lanes(runs, list(range(0, 16, 2))), ir_.lanes(runs, list(range(1, 16, 2))))
            sums = [ir_.total(parts), ir_.total([builder.mul(mins, pairs)])]
            return context.make_tuple(builder, signature.return_type, sums)

        return types.UniTuple(types.int32, 2)(w, o, qx, xo, bsums, bo), codegen

    return sums


q4_k_sums, q5_k_sums = _k4_sums(False), _k4_sums(True)


@intrinsic
def q6_k_sum(typingctx, w, o, qx, xo, bsums, bo):
    """sum over the 16 sub-blocks i of the Q6_K block at byte o of its int8 scale i times (its codes, 0-63,
    less 32) . qx[xo + 16 i:][:16], int32: the unsigned codes dotted, 32 sum_i scale_i bsums[bo + i] off."""
    if not _c_layout(w, qx, bsums):
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
        runs = ir_.load(4, 0, at=5, n=16, bits=32)  # the sums of qx over each 16
        offset = builder.shl(builder.mul(scales, runs), ir.Constant(ir.VectorType(I32, 16), [5] * 16))
        return builder.sub(ir_.total(parts), ir_.total([offset]))

    return types.int32(w, o, qx, xo, bsums, bo), codegen


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
    """(qx (T, Z) int8, dx (T, Z / 32) float32) of x: llama.cpp's Q8_0 rounding of activations on x86 (per 32
    values: qx the nearest integer of x 127 / max |x|, even on ties), the scale d = max |x| / 127 kept in
    float32 (llama.cpp rounds it to fp16)."""
    T, Z = x.shape
    qx, dx = np.empty((T, Z), np.int8), np.empty((T, Z // 32), F32)
    for t in range(T):
        for b in range(Z // 32):
            amax, finite = F32(0), True
            for j in range(32):
                a = abs(x[t, 32 * b + j])
                finite &= a <= FLT_MAX
                amax = max(amax, a)
            inv = F32(127) / amax if amax != 0 and finite else F32(0)
            for j in range(32):
                qx[t, 32 * b + j] = np.int32(np.rint(x[t, 32 * b + j] * inv))
            dx[t, b] = amax / F32(127) if finite else np.nan
    return qx, dx


@njit
def _row_q8_0(wr, qx, dx):
    return F64(q8_0_row(wr, qx, dx, dx.shape[0]))


@njit
def _row_q4_k(wr, qx, dx, bsums):
    acc = 0.0
    for b in range(qx.shape[0] // 256):
        o = 144 * b
        sum_i, sum_m = q4_k_sums(wr, o, qx, 256 * b, bsums, 16 * b)
        d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
        acc += F64(dx[b]) * (d * F64(sum_i) - dmin * F64(sum_m))
    return acc


@njit
def _row_q5_k(wr, qx, dx, bsums):
    acc = 0.0
    for b in range(qx.shape[0] // 256):
        o = 176 * b
        sum_i, sum_m = q5_k_sums(wr, o, qx, 256 * b, bsums, 16 * b)
        d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
        acc += F64(dx[b]) * (d * F64(sum_i) - dmin * F64(sum_m))
    return acc


@njit
def _row_q6_k(wr, qx, dx, bsums):
    acc = 0.0
    for b in range(qx.shape[0] // 256):
        o = 210 * b
        sum_i = q6_k_sum(wr, o, qx, 256 * b, bsums, 16 * b)
        acc += F64(dx[b]) * F64(_f16(wr[o + 208], wr[o + 209])) * F64(sum_i)
    return acc


# The matvecs spell their loops out, one per type: a row function passed as an argument to one shared
# loop is a first-class function to numba, which then cannot keep the kernel in its on-disk cache.


def matvec_q8_0(w, x, out):
    qx, dx = q8_0(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q8_0(w[r], qx[t], dx[t])


def matvec_q4_k(w, x, out):
    qx, dx, bsums = q8_k(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q4_k(w[r], qx[t], dx[t], bsums[t])


def matvec_q5_k(w, x, out):
    qx, dx, bsums = q8_k(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q5_k(w[r], qx[t], dx[t], bsums[t])


def matvec_q6_k(w, x, out):
    qx, dx, bsums = q8_k(x)
    for r in range(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, r] = _row_q6_k(w[r], qx[t], dx[t], bsums[t])
