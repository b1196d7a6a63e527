"""Compiled attention of a decode or verify pass over a GQA cache (kernels.prepare() compiles it; kernels.gqa_rows
runs it): each query row against the key and value rows it sees, read in place from the cache's strided views.

    gqa_part(q, k, v, pos0, scale, part, top, z, o)   every row's sums over the cache rows of one part
    gqa_merge(top, z, o, out)                          the parts merged, in part order
        q (T, H, E) float32 roped queries at positions pos0 .. pos0 + T - 1, any strides but the last (1);
        k, v (N, G E) float32 cache rows (N >= pos0 + T, the new rows written), any row stride;
        out (T, H E) float32: row t = softmax(scale q[t] K[:n].T) V[:n], n = pos0 + t + 1, query head h
        against KV head h // J (J = H / G); top, z (T, P, H) and o (T, P, H, E): the parts' sums.

It is what attention.gqa_attention computes for 1..SMALL_BATCH queries (ops.SMALL_BATCH), in another order,
for the kernel path (numpy's is the reference): numpy multiplies the scores of one KV head's queries by the
strided cache views in one matmul each, 3-4x the time of the arithmetic at a few thousand rows. Here each key
row is read once for all H heads, the next rows fetched ahead (AHEAD: the cache's rows lie a record apart,
where no hardware prefetcher follows), and the exponentials are a polynomial vectorized over the scores.

Order (fixed by this code alone, so the bits depend on no thread count, no T and no CPU):
- a score: 4 <8 x float> sums of q times k over 32 values at a time (the rest of E into the first), the four
  added (0 + 1) + (2 + 3), then the 8 lanes as a tree; times scale. No fused multiply-adds (LLVM makes none
  without fastmath), so every CPU gives the same bits. E: a multiple of 8 (gqa_attention checks).
- per part of PART rows: p = exp(s - max s), the sum of p in 8 partial sums (i mod 8) added as a tree, and
  sum_r p_r v_r in order of r, one <8 x float> fmul and fadd per 8 values;
- the parts merged in order, each times exp(its max - the largest) (one part: times 1, the sums as they are),
  then divided.
- exp: x = max(s - max s, -87.3), 2^k p(f) with k = floor(x / ln 2 + 1/2), f = x - k ln 2 (ln 2 in two parts),
  p a degree-7 Taylor polynomial (|f| <= ln 2 / 2): measured relative error 9.9e-8 (numpy's float32 exp: 2.0e-7);
  a row with a NaN score takes np.exp (NaN kept).
Accuracy (tests/test_kernel_attention.py): within 2.0e-7 of max |v| of a float64 softmax up to 4096 rows (numpy's
path: 2.7e-7).
Row t's result is a function of q[t] and the first n rows alone: a verify pass's rows are decoding's, bit
for bit (ops.linear's contract, kept for speculative decoding).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

F32 = np.float32
AHEAD = 64  # key (value) rows fetched ahead of the ones read (into L2: measured best from 48 to 128)
ROWS = 4  # key (value) rows taken side by side
PART = 512  # cache rows a part takes: a row's attention is computed by parts (shared by the pass's threads), merged
LINE = 16  # float32 values of a cache line
V8 = ir.VectorType(ir.FloatType(), 8)
I32, I64 = ir.IntType(32), ir.IntType(64)
LOG2E, LN2_HI, LN2_LO = F32(1.4426950408889634), F32(0.693145751953125), F32(1.4286068203094172e-06)
EXP_MIN = F32(-87.3)  # exp(x) below this is under float32's smallest normal: taken at this x (~1e-38)
TAYLOR = tuple(F32(1.0 / f) for f in (5040.0, 720.0, 120.0, 24.0, 6.0, 2.0, 1.0, 1.0))  # 1/7! .. 1/0!


def _vector_at(context, builder, array_type, array, index):
    """A <8 x float> pointer to element `index` of a 1-D array whose elements are adjacent."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [index]), V8.as_pointer())


def _loop(builder, count, body, init):
    """for k in range(count) (an i64): values = body(k, values), from init (IR values); returns the last."""
    start = builder.block
    loop, done = builder.append_basic_block("loop"), builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed(">", count, ir.Constant(I64, 0)), loop, done)
    builder.position_at_end(loop)
    k = builder.phi(I64)
    phis = [builder.phi(v.type) for v in init]
    after = body(k, phis)
    k1, end = builder.add(k, ir.Constant(I64, 1)), builder.block
    k.add_incoming(ir.Constant(I64, 0), start)
    k.add_incoming(k1, end)
    for phi, first, later in zip(phis, init, after, strict=True):
        phi.add_incoming(first, start)
        phi.add_incoming(later, end)
    builder.cbranch(builder.icmp_signed("<", k1, count), loop, done)
    builder.position_at_end(done)
    last = []
    for first, later in zip(init, after, strict=True):
        phi = builder.phi(first.type)
        phi.add_incoming(first, start)
        phi.add_incoming(later, end)
        last.append(phi)
    return last


def _lanes(builder, v, picks):
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(picks)), picks))


def _rows_of(rows) -> bool:
    """Whether `rows` is a tuple of 1-D float32 arrays (the rows an intrinsic takes at once)."""
    return isinstance(rows, types.UniTuple) and isinstance(rows.dtype, types.Array) and \
        rows.dtype.dtype == types.float32 and rows.dtype.ndim == 1


@intrinsic
def dots(typingctx, a, ia, rows, ib, e):
    """For each row b of the tuple `rows`: the float32 sum of a[ia + i] b[ib + i] for i < e (e a multiple of 8;
    1-D arrays, adjacent elements). Each row's sum is the same arithmetic alone or with others (they only
    run side by side)."""
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 1 and _rows_of(rows)):
        return None
    n = rows.count

    def codegen(context, builder, signature, args):
        av, iav, rv, ibv, ev = args
        row_values = [builder.extract_value(rv, j) for j in range(n)]
        eight, thirty_two = ir.Constant(I64, 8), ir.Constant(I64, 32)

        def product(j, i):
            x = builder.load(_vector_at(context, builder, signature.args[0], av, builder.add(iav, i)), align=4)
            y = builder.load(_vector_at(context, builder, rows.dtype, row_values[j], builder.add(ibv, i)), align=4)
            return builder.fmul(x, y)

        def four(k, sums):  # sums: row j's 4 vector sums at 4 j .. 4 j + 3
            at = builder.mul(k, thirty_two)
            return [builder.fadd(sums[4 * j + m], product(j, builder.add(at, ir.Constant(I64, 8 * m))))
                    for j in range(n) for m in range(4)]

        fours = builder.sdiv(ev, thirty_two)
        sums = _loop(builder, fours, four, [ir.Constant(V8, None)] * (4 * n))
        done = builder.mul(fours, thirty_two)
        firsts = _loop(builder, builder.sdiv(builder.sub(ev, done), eight),
                       lambda k, s: [builder.fadd(s[j], product(j, builder.add(done, builder.mul(k, eight))))
                                     for j in range(n)], [sums[4 * j] for j in range(n)])
        totals = []
        for j in range(n):
            v = builder.fadd(builder.fadd(firsts[j], sums[4 * j + 1]), builder.fadd(sums[4 * j + 2], sums[4 * j + 3]))
            v4 = builder.fadd(_lanes(builder, v, [0, 1, 2, 3]), _lanes(builder, v, [4, 5, 6, 7]))
            v2 = builder.fadd(_lanes(builder, v4, [0, 1]), _lanes(builder, v4, [2, 3]))
            total = builder.fadd(builder.extract_element(v2, ir.Constant(I32, 0)),
                                 builder.extract_element(v2, ir.Constant(I32, 1)))
            totals.append(total)
        return context.make_tuple(builder, signature.return_type, totals)

    return types.UniTuple(types.float32, n)(a, ia, rows, ib, e), codegen


@intrinsic
def add_scaled(typingctx, ps, rows, iv, o, io, e):
    """o[io + i] += p_j v_j[iv + i] for i < e (a multiple of 8), for the rows v_j of the tuple `rows` in order,
    with the weights p_j of the tuple `ps` (1-D arrays, adjacent elements): a row after another, each one
    fmul and one fadd per value, o kept in registers between rows (the same arithmetic as one row at a
    time)."""
    if not (_rows_of(rows) and isinstance(ps, types.UniTuple) and ps.count == rows.count
            and isinstance(o, types.Array) and o.dtype == types.float32 and o.ndim == 1):
        return None
    n = rows.count

    def codegen(context, builder, signature, args):
        pv, rv, ivv, ov, iov, ev = args
        weights = []
        for j in range(n):
            one = builder.insert_element(ir.Constant(V8, None), builder.extract_value(pv, j), ir.Constant(I32, 0))
            weights.append(_lanes(builder, one, [0] * 8))
        row_values = [builder.extract_value(rv, j) for j in range(n)]

        def step(k, _):
            at = builder.mul(k, ir.Constant(I64, 8))
            to = _vector_at(context, builder, signature.args[3], ov, builder.add(iov, at))
            acc = builder.load(to, align=4)
            for j in range(n):
                x = builder.load(_vector_at(context, builder, rows.dtype, row_values[j], builder.add(ivv, at)), align=4)
                acc = builder.fadd(acc, builder.fmul(weights[j], x))
            builder.store(acc, to, align=4)
            return []

        _loop(builder, builder.sdiv(ev, ir.Constant(I64, 8)), step, [])
        return context.get_dummy_value()

    return types.void(ps, rows, iv, o, io, e), codegen


@intrinsic
def fetch(typingctx, a, i):
    """Prefetch the cache line of a[i] (a 1-D) for reading."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        at = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
        module, i8p = builder.module, ir.IntType(8).as_pointer()
        f = module.globals.get("llvm.prefetch.p0i8") or ir.Function(
            module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
        builder.call(f, [at, ir.Constant(I32, 0), ir.Constant(I32, 1), ir.Constant(I32, 1)])  # (read, locality 1)
        return context.get_dummy_value()

    return types.void(a, i), codegen


@njit(inline="always")
def _fetch_row(rows, r):
    """Prefetch the cache lines of rows[r] (its values adjacent)."""
    row = rows[r]
    for i in range(0, row.size + LINE, LINE):
        fetch(row, min(i, row.size - 1))


@njit(inline="always")
def _ahead(rows, r, b):
    """(rows[r], .. rows[r + ROWS - 1]), the rows AHEAD after them (below b) fetched."""
    for ahead in range(r + AHEAD, min(b, r + AHEAD + ROWS)):
        _fetch_row(rows, ahead)
    return rows[r], rows[r + 1], rows[r + 2], rows[r + 3]


@njit
def _exp_sum(s, n, bits):
    """s[:n] <- exp(s[:n] - max); returns (max, their sum: 8 partial sums added as a tree); bits: (n,) int32
    scratch."""
    tops = np.full(8, -np.inf, F32)  # (8 partial maxima: the same maximum, vectorized)
    nan = False
    for i in range(n):
        tops[i % 8] = max(tops[i % 8], s[i])
        nan |= s[i] != s[i]
    m = tops.max()
    if nan or not np.isfinite(m):
        for i in range(n):
            s[i] = np.exp(s[i] - m)
    else:
        for i in range(n):  # (vectorized: no call, no branch)
            x = max(s[i] - m, EXP_MIN)
            k = np.floor(x * LOG2E + F32(0.5))
            f = (x - k * LN2_HI) - k * LN2_LO
            p = TAYLOR[0]
            for c in TAYLOR[1:]:
                p = p * f + c
            s[i] = p
            bits[i] = np.int32(k) << 23
        view = s[:n].view(np.int32)
        for i in range(n):
            view[i] += bits[i]  # p 2^k: k added to p's exponent (p in [0.7, 1.5], 2^k p normal)
    part = np.zeros(8, F32)
    for i in range(0, n - n % 8, 8):
        for j in range(8):
            part[j] += s[i + j]
    for i in range(n - n % 8, n):
        part[i % 8] += s[i]
    return m, ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]))


def gqa_part(q, k, v, pos0, scale, part, top, z, o):
    """Every query row t's attention over the cache rows of part `part` (rows part PART .. part PART + PART - 1,
    those row t sees): top[t, part, h] its largest score, z[t, part, h] the sum of p = exp(score - top) and
    o[t, part, h] (E,) the sum of p v; an empty part (past row t's last): -inf, 0 and 0."""
    t_count, h_count, e = q.shape
    g_count = k.shape[1] // e
    j_count = h_count // g_count
    s = np.empty((h_count, PART), F32)  # scores, then p
    bits = np.empty(PART, np.int32)
    a = part * PART
    for t in range(t_count):
        b = min(pos0 + t + 1, a + PART)
        ot = o[t, part]  # (H, E)
        ot[:] = 0
        if b <= a:
            top[t, part, :] = -np.inf
            z[t, part, :] = 0
            continue
        fours = a + (b - a) // ROWS * ROWS  # rows a .. fours - 1 by ROWS side by side, the rest one at a time
        for r in range(a, fours, ROWS):
            rows = _ahead(k, r, b)
            for g in range(g_count):
                for h in range(g * j_count, g * j_count + j_count):
                    d = dots(q[t, h], 0, rows, g * e, e)
                    for i in range(ROWS):
                        s[h, r - a + i] = d[i] * scale
        for r in range(fours, b):
            for h in range(h_count):
                s[h, r - a] = dots(q[t, h], 0, (k[r],), h // j_count * e, e)[0] * scale
        for h in range(h_count):
            top[t, part, h], z[t, part, h] = _exp_sum(s[h], b - a, bits)
        for r in range(a, fours, ROWS):
            rows, i = _ahead(v, r, b), r - a
            for g in range(g_count):
                for h in range(g * j_count, g * j_count + j_count):
                    add_scaled((s[h, i], s[h, i + 1], s[h, i + 2], s[h, i + 3]), rows, g * e, ot[h], 0, e)
        for r in range(fours, b):
            for h in range(h_count):
                add_scaled((s[h, r - a],), (v[r],), h // j_count * e, ot[h], 0, e)


def gqa_merge(top, z, o, out):
    """out (T, H E) = the parts' sums, in part order, each times exp(its top - the largest), divided."""
    t_count, parts, h_count, e = o.shape
    total = np.empty(e, F32)
    for t in range(t_count):
        for h in range(h_count):
            m = top[t, 0, h]
            for p in range(1, parts):
                m = max(m, top[t, p, h])
            total[:] = 0
            sum_z = F32(0)
            for p in range(parts):  # (one part: w = 1, the sums as they are)
                w = np.exp(top[t, p, h] - m)
                sum_z += z[t, p, h] * w
                for i in range(e):
                    total[i] += o[t, p, h, i] * w
            inv = F32(1) / sum_z
            for i in range(e):
                out[t, h * e + i] = total[i] * inv


def parts(rows: int) -> int:
    """The parts gqa_part computes for a pass over `rows` cache rows."""
    return -(-rows // PART)


def signatures():
    """numba's signatures of gqa_part and gqa_merge (kernels.prepare compiles them nogil, cached on disk)."""
    rows = types.Array(types.float32, 2, "A", readonly=True)
    q = types.Array(types.float32, 3, "A", readonly=True)
    top, o = types.Array(types.float32, 3, "C"), types.Array(types.float32, 4, "C")  # (T, P, H), (T, P, H, E)
    part = types.void(q, rows, rows, types.int64, types.float32, types.int64, top, top, o)
    merge = types.void(top.copy(readonly=True), top.copy(readonly=True), o.copy(readonly=True),
                       types.Array(types.float32, 2, "C"))
    return part, merge
