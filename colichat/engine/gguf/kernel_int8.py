"""The quantized types' products on int8 activations (llama.cpp's way): x rounded to 8 bits, integer dots.

Types (kernels.INT8_ACTIVATIONS, numbered by KINDS):
- Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS against x rounded to Q8_K (q8_k, ggml's quantize_row_q8_K: per 256
  values, d = max / -127 for the value of largest magnitude, qx the nearest integer of x / d, even on ties;
  and the sums of qx over each 16). A sub-block's 32 (or 16) codes are dotted with qx in int32, exactly;
  its integer scale is applied in int32 lanes, a minimum (or a code's offset: Q3_K's 4, Q6_K's 32) through
  the sums of qx.
- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL against x rounded to Q8_0 (q8_0: per 32 values, qx the nearest
  integer of x 127 / max |x|, d = max |x| / 127 kept in float32 where llama.cpp keeps fp16; and the sums of
  qx over each 32, which the offset codes (less 8 or 16) and the minimums take, as llama.cpp's Q8_1 does).
  Q8_0's signed codes: |code| times qx with the code's sign.
- IQ4_NL and IQ4_XS: a code is a byte of IQ4_VALUES, looked up (vpshufb) and taken 128 higher, unsigned;
  128 times the sums of qx is taken off.
A block's int32 lanes times its scales (d dx, and dmin dx) are added into 8 float32 lanes a row of x,
summed in order where the row ends.

The dot products are the compiled code's own: numba intrinsics (the row functions: q4_k_row, q8_0_row, ...)
emit LLVM vector IR for a whole row: a loop over its blocks, each block's codes unpacked in byte lanes once
and dotted with nt rows of x (NT at once, then one: the same arithmetic a row), 32 codes
(unsigned) times 32 int8 of qx summed into int32 lanes. On a CPU with int8 dot products (AVX-512 VNNI or
AVX-VNNI) each 32 codes are one vpdpbusd, and fp16 scales one vcvtph2ps (F16C); elsewhere portable IR
(widen to int16, multiply, widen; fp16 in integer steps) that LLVM lowers for the CPU numba compiles
for. numba keys its cache by the CPU, so a cache is never run on the wrong one. _product runs the rows
over x's rows, a chunk of them (CHUNK_BYTES of qx, kept in L2) at a time.

Accuracy: exact integers, so the only error beside float rounding is x's rounding: |x - dx qx| <= |dx| / 2,
so |out - x W.T| <= sum over x's blocks of |dx| / 2 sum |W| + 1e-5 sum |x| |W| (tests/test_kernels.py):
about 1-2% of the largest logit on the tiny models, the error llama.cpp's CPU backend has.
Measured (benchmarks/kernels.py, 4096 x 4096, T 1, a thread, this 2-core Zen 4 with AVX-512 VNNI, 2026-12-07
20:00 and 22:10), against the float32 activations of kernel_bodies.py / kernel_kquants.py: Q4_K 31 Gparam/s
(was 3.9-7.8), Q5_K 28 (2.7), Q6_K 32 (3.3), Q8_0 30 (4.6-7.3), Q4_0 27 (4.9), Q4_1 20 (3.3), Q5_0 20 (3.9),
Q5_1 17 (3.5), Q2_K 34 (1.3), Q3_K 27 (3.1), IQ4_NL 21 (1.8), IQ4_XS 27 (1.0).

Bits: each out[t, r] is a function of w[r] and x[t] alone (x[t]'s rounding is too), summed in a fixed
order: the same for any T, row split or thread count.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.extending import intrinsic

from .kernel_bodies import F32

FLT_MAX = np.finfo(np.float32).max
I8x32 = ir.VectorType(ir.IntType(8), 32)
I32 = ir.IntType(32)


def _host(*features: str) -> bool:
    """Whether the code numba compiles is for this CPU (numba's default) and it has all of `features`."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        return False
    have = binding.get_host_cpu_features()
    return all(have.get(f) for f in features)


def _vnni() -> bool:
    """Whether vpdpbusd (int8 dot products) can be emitted: AVX-VNNI, or AVX-512 VNNI with VL."""
    return _host("avxvnni") or _host("avx512vnni", "avx512vl")


class _IR:
    """The vector IR of one intrinsic's body: loads from numba arrays, integer dots, sums."""

    def __init__(self, context, builder, signature, args):
        self.context, self.b, self.types, self.args = context, builder, signature.args, args

    def load_at(self, arg: int, index, n: int = 32, bits: int = 8):
        """<n x i`bits`>: the n values from `index` (an IR integer) of the (C-contiguous) array args[arg] (of
        int8/uint8, or int32 for bits 32); n 1: the scalar."""
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

    def nibbles(self, index):
        """<32 x i8>: the low nibbles of the 16 bytes of w (args[0]) from `index`, then their high nibbles."""
        b, i8x16 = self.b, ir.VectorType(ir.IntType(8), 16)
        v = self.load_at(0, index, n=16)
        low, high = b.and_(v, ir.Constant(i8x16, [15] * 16)), b.lshr(v, ir.Constant(i8x16, [4] * 16))
        return b.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 32), list(range(32))))

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
        """The float32 of the fp16 bits h (i16): vcvtph2ps on a CPU with F16C; else in integer and exact
        float steps, (m + 1024 if e else m) 2^(max(e, 1) - 25), inf or NaN for e = 31, the sign bit on top
        (no library call). The same value either way (a NaN stays a NaN)."""
        b, i32 = self.b, I32
        if _host("f16c"):  # (vcvtph2ps: the same values; LLVM's half needs it, or crashes)
            return b.fpext(b.bitcast(h, ir.HalfType()), ir.FloatType())
        u = b.zext(h, i32)
        e, m = b.and_(b.lshr(u, ir.Constant(i32, 10)), ir.Constant(i32, 31)), b.and_(u, ir.Constant(i32, 1023))
        normal = b.icmp_unsigned("!=", e, ir.Constant(i32, 0))
        mant = b.select(normal, b.or_(m, ir.Constant(i32, 1024)), m)
        power = b.shl(b.add(b.select(normal, e, ir.Constant(i32, 1)), ir.Constant(i32, 102)), ir.Constant(i32, 23))
        value = b.bitcast(b.fmul(b.sitofp(mant, ir.FloatType()), b.bitcast(power, ir.FloatType())), i32)
        special = b.or_(ir.Constant(i32, 0x7F800000), b.shl(m, ir.Constant(i32, 13)))  # inf, or a NaN
        bits = b.select(b.icmp_unsigned("==", e, ir.Constant(i32, 31)), special, value)
        return b.bitcast(b.or_(bits, b.shl(b.and_(u, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))), ir.FloatType())

    def lookup(self, codes, table):
        """<32 x i8> of table[code] for codes 0-15 (table: 16 byte values): vpshufb where the CPU has AVX2,
        else a tree of selects on the codes' four bits (the same bytes)."""
        b = self.b
        if _host("avx2"):
            shuffle = self.function("llvm.x86.avx2.pshuf.b", I8x32, [I8x32, I8x32])
            return b.call(shuffle, [ir.Constant(I8x32, [v & 255 for v in table] * 2), codes])
        level = [self.bytes(v & 255) for v in table]
        for bit in range(4):
            on = b.icmp_unsigned("!=", b.and_(codes, self.bytes(1 << bit)), ir.Constant(I8x32, None))
            level = [b.select(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
        return level[0]

    def scaled(self, lanes, scales, first: int, second: int):
        """lanes times scale `first` in the lanes of values 0-15, scale `second` in those of 16-31 (scales:
        an int32 vector)."""
        n = lanes.type.count
        pick = ir.Constant(ir.VectorType(I32, n), [first] * (n // 2) + [second] * (n // 2))
        return self.b.mul(lanes, self.b.shuffle_vector(scales, scales, pick))


def _c_layout(*arrays) -> bool:
    return all(a.layout == "C" for a in arrays)  # (the bytes are read as one run from the first)


class _Rows(_IR):
    """The IR of a row intrinsic: (w, qx, dx, sums, t, blocks, nt) -> the nt float32 dot products of the row w
    (`blocks` blocks) with x's rows t .. t + nt - 1 (qx, dx, bsums flat: x's rounding, row after row).
    A loop over the blocks keeps a <8 x float> of sums a token; each token's arithmetic is the same
    whatever nt is (the bits of out[t, r] do not depend on T)."""

    def __init__(self, context, builder, signature, args, nt: int, per_block: int):
        super().__init__(context, builder, signature, args)
        self.nt, self.per_block, self.i64 = nt, per_block, ir.IntType(64)
        t, self.blocks = args[4], args[5]  # (w, qx, dx, sums, t, blocks, the rows of x)
        self.v8f = ir.VectorType(ir.FloatType(), 8)
        # per token: its first element of qx, dx and bsums
        self.tokens = [builder.add(t, ir.Constant(self.i64, i)) for i in range(nt)]

    def const(self, v: int):
        return ir.Constant(self.i64, v)

    def scalar_f32(self, arg: int, index):
        data = self.context.make_array(self.types[arg])(self.context, self.b, self.args[arg]).data
        return self.b.load(self.b.gep(data, [index]))

    def splat_f(self, v):
        b = self.b
        one = b.insert_element(ir.Constant(self.v8f, None), v, ir.Constant(I32, 0))
        return b.shuffle_vector(one, ir.Constant(self.v8f, None), ir.Constant(ir.VectorType(I32, 8), [0] * 8))

    def loop(self, body):
        """For b in 0 .. blocks - 1: sums = body(b, sums) (nt <8 x float>, from zeros); then each token's
        lanes added in order, lane 0 first (no reassociation): the tuple of nt float32."""
        b, zero = self.b, self.const(0)
        start = b.block
        loop, done = b.append_basic_block("row.loop"), b.append_basic_block("row.done")
        b.cbranch(b.icmp_signed(">", self.blocks, zero), loop, done)
        b.position_at_end(loop)
        k = b.phi(self.i64)
        sums = [b.phi(self.v8f) for _ in range(self.nt)]
        after = body(k, sums)
        following = b.add(k, self.const(1))
        k.add_incoming(zero, start)
        k.add_incoming(following, b.block)
        for phi, value in zip(sums, after, strict=True):
            phi.add_incoming(ir.Constant(self.v8f, None), start)
            phi.add_incoming(value, b.block)
        end = b.block
        b.cbranch(b.icmp_signed("<", following, self.blocks), loop, done)
        b.position_at_end(done)
        f32 = ir.FloatType()
        reduce = self.function("llvm.vector.reduce.fadd.v8f32", f32, [f32, self.v8f])
        totals = [b.phi(self.v8f) for _ in after]  # (a block's phis come first)
        for total, value in zip(totals, after, strict=True):
            total.add_incoming(ir.Constant(self.v8f, None), start)
            total.add_incoming(value, end)
        totals = [b.call(reduce, [ir.Constant(f32, -0.0), total]) for total in totals]
        return self.context.make_tuple(b, types.UniTuple(types.float32, self.nt), totals)

    def sixteens(self, i: int, k, codes, scales):
        """Token i's int32 lanes of block k's 16 sub-blocks of 16 values: codes[4 h + g] (32 unsigned bytes) are
        values 128 h + 32 g + l, sub-blocks 8 h + 2 g and 8 h + 2 g + 1, each dot times its scale (scales: 16
        int32 lanes)."""
        dots = None
        for n, c in enumerate(codes):
            h, g = divmod(n, 4)
            lanes = self.dot_lanes(c, self.load_at(1, self.x_index(i, k, 1, 128 * h + 32 * g)))
            part = self.scaled(lanes, scales, 8 * h + 2 * g, 8 * h + 2 * g + 1)
            dots = part if dots is None else self.b.add(dots, part)
        return dots

    def weighted_sums(self, i: int, k, weights):
        """8 int32 lanes whose sum is sum_j weights[j] (sum of token i's qx over sixteen j of block k): weights
        16 int32 lanes (of a Q8_K block's 16 sums)."""
        runs = self.load_at(3, self.x_index(i, k, 16), n=16, bits=32)
        both = self.b.mul(weights, runs)
        return self.b.add(self.lanes(both, list(range(8))), self.lanes(both, list(range(8, 16))))

    def x_index(self, i: int, k, per: int, offset: int = 0):
        """The index of token i's value (per = 1: qx), block scale (per = 256 or 32: dx) or sum of 16 (per = 16:
        bsums) at value offset `offset` of block k (of self.per_block values)."""
        b = self.b
        row = b.mul(self.tokens[i], b.mul(self.blocks, self.const(self.per_block // per)))
        return b.add(row, b.add(b.mul(k, self.const(self.per_block // per)), self.const(offset // per)))


def _row_of(per_block: int, size: int, block):
    """The row intrinsic (w, qx, dx, sums, t, blocks, nt) -> nt float32 of a type whose blocks are `size` bytes
    of `per_block` values, nt a constant (its code is made for it): block(r, at, k, sums) emits block k's
    arithmetic (r: its _Rows; at(offset): the index of byte `offset` of block k in w) and returns the nt new
    sums."""

    @intrinsic
    def row(typingctx, w, qx, dx, sums, t, blocks, rows_of_x):
        if not _c_layout(w, qx, dx, sums) or not isinstance(rows_of_x, types.IntegerLiteral):
            return None
        nt = rows_of_x.literal_value

        def codegen(context, builder, signature, args):
            r = _Rows(context, builder, signature, args, nt, per_block)

            def one(k, accs):
                o = builder.mul(k, r.const(size))
                return block(r, lambda offset: builder.add(o, r.const(offset)), k, accs)

            return r.loop(one)

        return types.UniTuple(types.float32, nt)(w, qx, dx, sums, t, blocks, rows_of_x), codegen

    return row


def _k4_row(fifth: bool):
    """The row intrinsic of Q4_K (fifth False) or Q5_K (True: 32 bytes qh at byte 16 before the nibbles, bit j
    of qh[l] the fifth bit of value l of sub-block j) against x rounded to Q8_K, nt tokens: per block,
    dx (d sum_j sc_j (codes_j . qx_j) - dmin sum_j m_j (sum of qx_j)), its six-bit scales sc and minimums m
    unpacked in lanes, the sums kept in lanes until the row ends."""
    size = 176 if fifth else 144

    def block(r, at, k, sums):
        b, and_, or_ = r.b, r.b.and_, r.b.or_
        d, dmin = r.half(r.load_at(0, at(0), n=1, bits=16)), r.half(r.load_at(0, at(2), n=1, bits=16))
        s = b.zext(r.load_at(0, at(4), n=16), ir.VectorType(I32, 16))  # the 12 scale bytes (and 4 more)
        # sc_j: byte j & 63 (j < 4), else byte j + 4 & 15 | (byte j - 4 >> 6) << 4
        # m_j: byte j + 4 & 63 (j < 4), else byte j + 4 >> 4 | (byte j >> 6) << 4
        first, second = r.lanes(s, [0, 1, 2, 3, 8, 9, 10, 11]), r.lanes(s, [4, 5, 6, 7, 8, 9, 10, 11])
        top_sc = b.shl(b.lshr(r.lanes(s, [0, 1, 2, 3, 0, 1, 2, 3]), r.ints(6)), r.ints(4))
        top_m = b.shl(b.lshr(r.lanes(s, [0, 1, 2, 3, 4, 5, 6, 7]), r.ints(6)), r.ints(4))
        scales = r.join(and_(first, r.ints(63)), or_(and_(first, r.ints(15)), top_sc), 8)
        mins = r.join(and_(second, r.ints(63)), or_(b.lshr(second, r.ints(4)), top_m), 8)
        high_bits = r.load_at(0, at(16)) if fifth else None
        codes = []
        for c in range(4):  # 32 bytes: sub-block 2 c in the low nibbles, 2 c + 1 in the high ones
            nibbles = r.load_at(0, at((48 if fifth else 16) + 32 * c))
            for j, part in ((2 * c, and_(nibbles, r.bytes(15))), (2 * c + 1, b.lshr(nibbles, r.bytes(4)))):
                if fifth:
                    bit = and_(b.lshr(high_bits, r.bytes(j)), r.bytes(1))
                    part = or_(part, b.shl(bit, r.bytes(4)))
                codes.append(part)
        out = []
        for i, acc in enumerate(sums):
            parts = [r.scaled(r.dot_lanes(codes[j], r.load_at(1, r.x_index(i, k, 1, 32 * j))), scales, j, j)
                     for j in range(8)]
            dots = parts[0]
            for p in parts[1:]:
                dots = b.add(dots, p)
            runs = r.load_at(3, r.x_index(i, k, 16), n=16, bits=32)  # the sums of qx over each 16
            pairs = b.add(r.lanes(runs, list(range(0, 16, 2))), r.lanes(runs, list(range(1, 16, 2))))
            scale = r.scalar_f32(2, r.x_index(i, k, 256))
            lanes = b.fsub(b.fmul(b.sitofp(dots, r.v8f), r.splat_f(b.fmul(scale, d))),
                           b.fmul(b.sitofp(b.mul(mins, pairs), r.v8f), r.splat_f(b.fmul(scale, dmin))))
            out.append(b.fadd(acc, lanes))
        return out

    return _row_of(256, size, block)


def _q6_k_row():
    """Q6_K's row intrinsic against x rounded to Q8_K, nt tokens: per block, dx d sum over its 16 sub-blocks i
    of its int8 scale i times (codes 0-63 . qx_i - 32 (sum of qx_i)), kept in lanes until the row ends."""

    def block(r, at, k, sums):
        b = r.b
        scales = b.sext(r.load_at(0, at(192), n=16), ir.VectorType(I32, 16))
        d = r.half(r.load_at(0, at(208), n=1, bits=16))
        codes = []
        for h in range(2):
            for g in range(4):  # values 128 h + 32 g + l: sub-blocks 8 h + 2 g and 8 h + 2 g + 1
                low = b.and_(b.lshr(r.load_at(0, at(64 * h + 32 * (g & 1))), r.bytes(4 * (g >> 1))),
                             r.bytes(15))
                high = b.and_(b.lshr(r.load_at(0, at(128 + 32 * h)), r.bytes(2 * g)), r.bytes(3))
                codes.append(b.or_(low, b.shl(high, r.bytes(4))))
        out = []
        for i, acc in enumerate(sums):
            dots = r.sixteens(i, k, codes, scales)
            offset = b.shl(r.weighted_sums(i, k, scales), r.ints(5))  # 32 sum_i scale_i (sum of qx_i)
            scale = b.fmul(r.scalar_f32(2, r.x_index(i, k, 256)), d)
            out.append(b.fadd(acc, b.fmul(b.sitofp(b.sub(dots, offset), r.v8f), r.splat_f(scale))))
        return out

    return _row_of(256, 210, block)


def _q3_k_row():
    """Q3_K's row intrinsic against x rounded to Q8_K, nt tokens: per block, dx d sum over its 16 sub-blocks i of
    (its six-bit scale i - 32) times (codes 0-7 . qx_i - 4 (sum of qx_i)): a code is its two low bits (qs) and
    the hmask bit above them, the value less 4."""

    def block(r, at, k, sums):
        b = r.b
        v16 = ir.VectorType(I32, 16)
        # scale i: low four bits from byte i % 8 (>> 4 for i >= 8), two high bits from byte 8 + i % 4
        # (>> 2 (i // 4)), less 32
        low = b.zext(r.lanes(r.load_at(0, at(96), n=8), list(range(8)) * 2), v16)
        high = b.zext(r.lanes(r.load_at(0, at(104), n=4), list(range(4)) * 4), v16)
        low = b.and_(b.lshr(low, ir.Constant(v16, [0] * 8 + [4] * 8)), r.ints(15, 16))
        high = b.and_(b.lshr(high, ir.Constant(v16, [2 * (i // 4) for i in range(16)])), r.ints(3, 16))
        scales = b.sub(b.or_(low, b.shl(high, r.ints(4, 16))), r.ints(32, 16))
        d = r.half(r.load_at(0, at(108), n=1, bits=16))
        hmask = r.load_at(0, at(0))
        codes = []
        for h in range(2):
            q = r.load_at(0, at(32 + 32 * h))
            for g in range(4):  # values 128 h + 32 g + l
                two = b.and_(b.lshr(q, r.bytes(2 * g)), r.bytes(3))
                third = b.and_(b.lshr(hmask, r.bytes(4 * h + g)), r.bytes(1))
                codes.append(b.or_(two, b.shl(third, r.bytes(2))))
        out = []
        for i, acc in enumerate(sums):
            dots = b.sub(r.sixteens(i, k, codes, scales), b.shl(r.weighted_sums(i, k, scales), r.ints(2)))
            scale = b.fmul(r.scalar_f32(2, r.x_index(i, k, 256)), d)
            out.append(b.fadd(acc, b.fmul(b.sitofp(dots, r.v8f), r.splat_f(scale))))
        return out

    return _row_of(256, 110, block)


def _q2_k_row():
    """Q2_K's row intrinsic against x rounded to Q8_K, nt tokens: per block, dx (d sum_i sc_i (codes_i . qx_i)
    - dmin sum_i m_i (sum of qx_i)) over its 16 sub-blocks, sc_i and m_i the low and high nibbles of byte i,
    a code two bits of qs."""

    def block(r, at, k, sums):
        b = r.b
        s = b.zext(r.load_at(0, at(0), n=16), ir.VectorType(I32, 16))
        scales, mins = b.and_(s, r.ints(15, 16)), b.lshr(s, r.ints(4, 16))
        d, dmin = r.half(r.load_at(0, at(80), n=1, bits=16)), r.half(r.load_at(0, at(82), n=1, bits=16))
        codes = []
        for h in range(2):
            q = r.load_at(0, at(16 + 32 * h))
            codes += [b.and_(b.lshr(q, r.bytes(2 * g)), r.bytes(3)) for g in range(4)]
        out = []
        for i, acc in enumerate(sums):
            dots = r.sixteens(i, k, codes, scales)
            scale = r.scalar_f32(2, r.x_index(i, k, 256))
            lanes = b.fsub(b.fmul(b.sitofp(dots, r.v8f), r.splat_f(b.fmul(scale, d))),
                           b.fmul(b.sitofp(r.weighted_sums(i, k, mins), r.v8f), r.splat_f(b.fmul(scale, dmin))))
            out.append(b.fadd(acc, lanes))
        return out

    return _row_of(256, 84, block)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _iq4_xs_row():
    """IQ4_XS's row intrinsic against x rounded to Q8_K, nt tokens: per block, dx d sum over its 8 sub-blocks j
    of (its six-bit scale j - 32) times (IQ4_VALUES[codes_j] . qx_j); the values taken 128 higher (unsigned
    bytes), and 128 (sum of qx_j) taken off."""

    def block(r, at, k, sums):
        b = r.b
        v8 = ir.VectorType(I32, 8)
        d = r.half(r.load_at(0, at(0), n=1, bits=16))
        # scale j: nibble j % 2 of scales_l[j // 2], bits 2 j, 2 j + 1 of scales_h above it, less 32
        low = b.zext(r.lanes(r.load_at(0, at(4), n=4), [j // 2 for j in range(8)]), v8)
        low = b.and_(b.lshr(low, ir.Constant(v8, [4 * (j % 2) for j in range(8)])), r.ints(15))
        high = b.zext(r.load_at(0, at(2), n=1, bits=16), I32)
        high = b.shuffle_vector(b.insert_element(ir.Constant(v8, None), high, ir.Constant(I32, 0)),
                                ir.Constant(v8, None), ir.Constant(v8, [0] * 8))
        high = b.and_(b.lshr(high, ir.Constant(v8, [2 * j for j in range(8)])), r.ints(3))
        scales = b.sub(b.or_(low, b.shl(high, r.ints(4))), r.ints(32))
        pairs = r.lanes(scales, [j // 2 for j in range(16)])  # each scale for its two sums of 16
        codes = [r.lookup(r.nibbles(at(8 + 16 * j)), [v + 128 for v in IQ4_VALUES]) for j in range(8)]
        out = []
        for i, acc in enumerate(sums):
            dots = None
            for j, c in enumerate(codes):
                part = r.scaled(r.dot_lanes(c, r.load_at(1, r.x_index(i, k, 1, 32 * j))), scales, j, j)
                dots = part if dots is None else b.add(dots, part)
            dots = b.sub(dots, b.shl(r.weighted_sums(i, k, pairs), r.ints(7)))
            scale = b.fmul(r.scalar_f32(2, r.x_index(i, k, 256)), d)
            out.append(b.fadd(acc, b.fmul(b.sitofp(dots, r.v8f), r.splat_f(scale))))
        return out

    return _row_of(256, 136, block)


def _q8_0_row():
    """Q8_0's row intrinsic against x rounded to Q8_0, nt tokens: each block's codes (as |code|, and qx with the
    code's sign: unsigned times signed) dotted in 8 int32 lanes, the lanes times d dx added into 8 float32
    lanes (x's sums unused)."""

    def block(r, at, k, accs):
        b = r.b
        d = r.half(r.load_at(0, at(0), n=1, bits=16))
        codes = r.load_at(0, at(2))
        negative = b.icmp_signed("<", codes, ir.Constant(I8x32, None))
        magnitude = b.select(negative, b.neg(codes), codes)  # (-128: 128 as unsigned)
        out = []
        for i, acc in enumerate(accs):
            xv = r.load_at(1, r.x_index(i, k, 1))
            signed_x = b.select(negative, b.neg(xv), xv)  # (|qx| <= 127)
            lanes = b.sitofp(r.dot_lanes(magnitude, signed_x), r.v8f)
            scale = b.fmul(d, r.scalar_f32(2, r.x_index(i, k, 32)))
            out.append(b.fadd(acc, b.fmul(lanes, r.splat_f(scale))))
        return out

    return _row_of(32, 34, block)


def _q4_row(size: int, minimum: bool, fifth: bool, table: bool = False):
    """The row intrinsic of Q4_0 (size 18: d, 16 bytes of nibbles), Q4_1 (20: d, m, nibbles), Q5_0 (22: d,
    qh, nibbles), Q5_1 (24: d, m, qh, nibbles) or IQ4_NL (18, table: a code is IQ4_VALUES[nibble], taken 128
    higher) against x rounded to Q8_0 with its sums, nt tokens. Byte l's low nibble is code l, its high one
    code 16 + l; bit l of qh (32 bits) the fifth bit of code l.
    Per block: d dx (codes . qx - offset sum qx) (offset 8, 16 or 128 without a minimum), + m dx sum qx."""
    offset = 128 if table else 0 if minimum else (16 if fifth else 8)
    at_qh = 4 if minimum else 2
    at_codes = at_qh + (4 if fifth else 0)

    def block(r, at, k, accs):
        b = r.b
        d = r.half(r.load_at(0, at(0), n=1, bits=16))
        m = r.half(r.load_at(0, at(2), n=1, bits=16)) if minimum else None
        codes = r.nibbles(at(at_codes))
        if table:
            codes = r.lookup(codes, [v + 128 for v in IQ4_VALUES])
        if fifth:
            qh = r.load_at(0, at(at_qh), n=1, bits=32)
            bits = b.zext(b.bitcast(qh, ir.VectorType(ir.IntType(1), 32)), I8x32)
            codes = b.or_(codes, b.shl(bits, r.bytes(4)))
        out = []
        for i, acc in enumerate(accs):
            dots = r.dot_lanes(codes, r.load_at(1, r.x_index(i, k, 1)))
            block_of_x = r.x_index(i, k, 32)
            total = r.load_at(3, block_of_x, n=1, bits=32)  # the sum of this block's qx
            if offset:
                off = b.insert_element(ir.Constant(ir.VectorType(I32, 8), None),
                                       b.mul(total, ir.Constant(I32, offset)), ir.Constant(I32, 0))
                dots = b.sub(dots, off)
            scale = r.scalar_f32(2, block_of_x)
            lanes = b.fmul(b.sitofp(dots, r.v8f), r.splat_f(b.fmul(d, scale)))
            if minimum:
                low_lane = b.fmul(b.sitofp(total, ir.FloatType()), b.fmul(m, scale))
                lanes = b.fadd(lanes, b.insert_element(ir.Constant(r.v8f, None), low_lane, ir.Constant(I32, 0)))
            out.append(b.fadd(acc, lanes))
        return out

    return _row_of(32, size, block)


NT = 4  # rows of x a row intrinsic takes at once: their codes unpacked once
q4_k_row, q5_k_row, q6_k_row = _k4_row(False), _k4_row(True), _q6_k_row()
q8_0_row, q4_0_row, q4_1_row = _q8_0_row(), _q4_row(18, False, False), _q4_row(20, True, False)
q5_0_row, q5_1_row, iq4_nl_row = _q4_row(22, False, True), _q4_row(24, True, True), _q4_row(18, False, False, True)
iq4_xs_row, q2_k_row, q3_k_row = _iq4_xs_row(), _q2_k_row(), _q3_k_row()


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


def q8_k(x):
    """(qx, dx, bsums) of x: quantize_q8_k into new arrays (compiled by kernels.py)."""
    T, Z = x.shape
    qx, dx, bsums = np.empty((T, Z), np.int8), np.empty((T, Z // 256), F32), np.empty((T, Z // 16), np.int32)
    quantize_q8_k(x, qx, dx, bsums)
    return qx, dx, bsums


@njit
def quantize_q8_0(x, qx, dx):
    """x (T, Z) float32 -> qx (T, Z) int8, dx (T, Z / 32) float32: llama.cpp's Q8_0 rounding of activations on
    x86 (per 32 values: qx the nearest integer of x 127 / max |x|, even on ties), the scale d = max |x| / 127
    kept in float32 (llama.cpp rounds it to fp16)."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax, finite = F32(0), True
            for j in range(32):
                a = abs(x[t, 32 * b + j])
                finite &= a <= FLT_MAX
                amax = max(amax, a)
            inv = F32(127) / amax if amax != 0 and finite else F32(0)
            for j in range(32):
                qx[t, 32 * b + j] = np.int32(np.rint(x[t, 32 * b + j] * inv))
            dx[t, b] = amax / F32(127) if finite else np.nan


@njit
def _sums(qx, sums):
    """sums (T, Z / 32) int32: the sums of qx (T, Z) over each 32."""
    for t in range(qx.shape[0]):
        for b in range(qx.shape[1] // 32):
            s = 0
            for j in range(32):
                s += np.int32(qx[t, 32 * b + j])
            sums[t, b] = s


def q8_0(x):
    """(qx, dx, sums) of x: quantize_q8_0 into new arrays, and the sums of qx over each 32 (compiled by
    kernels.py)."""
    T, Z = x.shape
    qx, dx, sums = np.empty((T, Z), np.int8), np.empty((T, Z // 32), F32), np.empty((T, Z // 32), np.int32)
    quantize_q8_0(x, qx, dx)
    _sums(qx, sums)
    return qx, dx, sums


CHUNK_BYTES = 512 << 10  # x's rows a product takes at once: their qx stays in L2
# the types, by their number here
KINDS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K")


@njit
def _chunk(z):
    """The rows of x (of z values) a product takes at a time: CHUNK_BYTES of qx, a multiple of NT."""
    return max(NT, CHUNK_BYTES // z // NT * NT)


@njit(inline="always")  # (kind and nt constants where it is called: one branch compiled)
def _dots(kind, wr, qx, dx, sums, t, blocks, nt):
    """Row wr of type KINDS[kind] times x's rows t .. t + nt - 1: nt float32."""
    if kind == 0:
        return q8_0_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 1:
        return q4_0_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 2:
        return q4_1_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 3:
        return q5_0_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 4:
        return q5_1_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 5:
        return q4_k_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 6:
        return q5_k_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 7:
        return q6_k_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 8:
        return iq4_nl_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 9:
        return iq4_xs_row(wr, qx, dx, sums, t, blocks, nt)
    if kind == 10:
        return q2_k_row(wr, qx, dx, sums, t, blocks, nt)
    return q3_k_row(wr, qx, dx, sums, t, blocks, nt)


@njit(inline="always")  # (kind a constant where it is called: one branch compiled)
def _product(kind, w, qx, dx, sums, out):
    """out (T, R) = x's rows (rounded: qx, dx and its sums) times the rows w of type KINDS[kind]: NT rows of x
    at once, then one by one (the same arithmetic a row), a chunk of x's rows at a time."""
    T, tokens, blocks = qx.shape[0], _chunk(qx.shape[1]), dx.shape[1]
    qx, dx, sums = qx.reshape(-1), dx.reshape(-1), sums.reshape(-1)
    for c in range(0, T, tokens):
        end = min(T, c + tokens)
        for r in range(w.shape[0]):
            t = c
            while t + NT <= end:
                ys = _dots(kind, w[r], qx, dx, sums, t, blocks, NT)
                for i in range(NT):
                    out[t + i, r] = ys[i]
                t += NT
            while t < end:
                out[t, r] = _dots(kind, w[r], qx, dx, sums, t, blocks, 1)[0]
                t += 1


def _product_of(kind: int):
    """The product kernels.py compiles for type KINDS[kind]: the kind a constant of its code (a closure over an
    int, which numba keeps in its on-disk cache; the row intrinsics cannot be passed as arguments), its own
    name so that each type has its own cache index."""

    def product(w, qx, dx, sums, out):
        _product(kind, w, qx, dx, sums, out)

    product.__name__ = product.__qualname__ = f"product_{KINDS[kind].lower()}"
    return product


(product_q8_0, product_q4_0, product_q4_1, product_q5_0, product_q5_1, product_q4_k, product_q5_k, product_q6_k,
 product_iq4_nl, product_iq4_xs, product_q2_k, product_q3_k) = (_product_of(kind) for kind in range(len(KINDS)))
