"""The compiled kernels (engine/gguf/kernels.py) measured: matvec Gparam/s per type on a matrix of a real
size, on 1 thread and on 2 (two Python threads on the row halves), against numpy's f32 matvec on the
dequantized matrix and against the memory bandwidth (the quantized bytes read per second against a
measured memcpy and sum); the compile and the cached start; and the variants tried (each int8 type's
float32 sums against its int8 products; no fastmath and numba's own byte loops on Q4_K and Q8_0).

    python benchmarks/kernels.py                          # every type, 14336 x 4096 (Llama-3.1-8B's FFN)
    python benchmarks/kernels.py --variants               # per int8 type: float32 sums against int8 products
    python benchmarks/kernels.py --start                  # first compile and cached start, in fresh processes
    python benchmarks/kernels.py --attention              # decode's attention: numpy's against the compiled one

Each figure is the best of --repeat runs (other load on the machine only slows a run down). Also: CPU
seconds of one thread (thread_time), which other processes on the cores disturb less than the clock.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from colichat.engine.gguf import kernels

FP16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,),
           "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def say(msg: str) -> None:
    print(msg, flush=True)


def random_rows(name: str, rows: int, z: int, rng) -> np.ndarray:
    """(rows, row_bytes) uint8: random codes and scale bytes under small valid fp16 scales."""
    if name in ("F32", "F16", "BF16"):
        v = rng.standard_normal((rows, z), dtype=np.float32)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8) if name == "BF16" else \
            v.astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    values, size = kernels.block(name)
    raw = rng.integers(0, 256, (rows, z // values, size), dtype=np.uint8)
    for at in FP16_AT[name]:
        raw[:, :, at : at + 2] = np.float16(0.01).reshape(1).view(np.uint8)
    return raw.reshape(rows, -1)


def best(fn, repeat: int) -> tuple[float, float]:
    """(best wall seconds, best thread CPU seconds) of fn() over `repeat` runs."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.thread_time() - c0)
    return wall, cpu


def on_two_threads(fn, n: int):
    """A function running fn(0, n // 2) and fn(n // 2, n) on two Python threads at once."""
    def run():
        half = n // 2
        threads = [threading.Thread(target=fn, args=ab) for ab in ((0, half), (half, n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return run


def bandwidth(repeat: int) -> tuple[float, float]:
    """(memcpy GB/s counting bytes read and written, sum GB/s of bytes read), one thread, 512 MiB."""
    a = np.ones(1 << 26, dtype=np.float64)
    b = np.empty_like(a)
    copy, _ = best(lambda: np.copyto(b, a), repeat)
    total, _ = best(lambda: a.sum(), repeat)
    return 2 * a.nbytes / copy / 1e9, a.nbytes / total / 1e9


def numpy_f32(w32: np.ndarray, x: np.ndarray, repeat: int) -> tuple[float, float]:
    """(1 thread, 2 threads) Gparam/s of numpy's x @ W.T on the f32 matrix (OpenBLAS's own threads)."""
    from threadpoolctl import threadpool_limits

    n = w32.size
    with threadpool_limits(1, user_api="blas"):
        one, _ = best(lambda: x @ w32.T, repeat)
    with threadpool_limits(2, user_api="blas"):
        two, _ = best(lambda: x @ w32.T, repeat)
    return n / one / 1e9, n / two / 1e9


def measure_types(args) -> None:
    rng = np.random.default_rng(0)
    R, Z = args.rows, args.cols
    copy_bw, sum_bw = bandwidth(args.repeat)
    say(f"memory: memcpy {copy_bw:.1f} GB/s (read + written), sum {sum_bw:.1f} GB/s read; one thread")
    x = rng.standard_normal((args.t, Z), dtype=np.float32)
    say(f"matrix {R} x {Z}, T = {args.t}; Gparam/s = R Z T / s; GB/s = the quantized bytes / s")
    say(f"{'type':7} {'B/param':>7} {'1 thread':>9} {'(cpu)':>7} {'2 threads':>9} {'GB/s 2t':>8} "
        f"{'of sum bw':>9} {'numpy f32 1t/2t':>16}")
    for name in args.types:
        measure_type(name, random_rows(name, R, Z, rng), x, args, sum_bw)


def measure_type(name: str, w: np.ndarray, x: np.ndarray, args, sum_bw: float) -> None:
    R, Z = w.shape[0], x.shape[1]
    out = np.empty((x.shape[0], R), dtype=np.float32)
    kernels.matvec(name, w[:8], x, out[:, :8])  # compiled before the clock starts
    one, cpu = best(lambda: kernels.matvec(name, w, x, out), args.repeat)
    two, _ = best(on_two_threads(lambda a, b: kernels.matvec(name, w[a:b], x, out[:, a:b]), R), args.repeat)
    ref = ""
    if args.numpy:
        w32 = np.empty((R, Z), dtype=np.float32)
        kernels.dequantize(name, w, w32)
        n1, n2 = numpy_f32(w32, x, args.repeat)
        ref = f"{n1:7.2f} /{n2:6.2f}"
    p = R * Z * x.shape[0]
    say(f"{name:7} {w.nbytes / (R * Z):7.4f} {p / one / 1e9:9.2f} {p / cpu / 1e9:7.2f} {p / two / 1e9:9.2f} "
        f"{w.nbytes / two / 1e9:8.2f} {w.nbytes / two / 1e9 / sum_bw:9.2f} {ref:>16}")


def int8_kernels():
    """The variants with int8 activations (llama.cpp's Q8_0 way: x quantized once per call in blocks of 32,
    integer dot products, the scales applied per sub-block): (quantize, Q8_0 matvec, Q4_K matvec)."""
    from numba import njit

    from colichat.engine.gguf.kernel_bodies import F32, F64, _f16
    from colichat.engine.gguf.kernel_kquants import _scale_min_k4

    @njit(nogil=True)
    def quantize(x):
        T, n = x.shape[0], x.shape[1] // 32
        q, dx = np.empty(x.shape, np.int8), np.empty((T, n), F32)
        for t in range(T):
            for j in range(n):
                amax = F32(0)
                for i in range(32):
                    amax = max(amax, abs(x[t, 32 * j + i]))
                dx[t, j] = amax / F32(127)
                inv = F32(127) / amax if amax > 0 else F32(0)
                for i in range(32):
                    q[t, 32 * j + i] = np.int8(np.rint(x[t, 32 * j + i] * inv))
        return q, dx

    @njit(nogil=True)
    def q8_0(w, xq, dx, out):
        for r in range(w.shape[0]):
            for t in range(xq.shape[0]):
                acc = 0.0
                for b in range(xq.shape[1] // 32):
                    o, s = 34 * b, np.int32(0)
                    for i in range(32):
                        s = np.int32(s + np.int32(np.int8(w[r, o + 2 + i])) * np.int32(xq[t, 32 * b + i]))
                    acc += F64(_f16(w[r, o], w[r, o + 1])) * F64(dx[t, b]) * s
                out[t, r] = acc

    @njit(nogil=True)
    def q4_k(w, xq, dx, xs, out):
        for r in range(w.shape[0]):
            wr = w[r]
            for t in range(xq.shape[0]):
                acc = 0.0
                for b in range(xq.shape[1] // 256):
                    o = 144 * b
                    d, dmin = F64(_f16(wr[o], wr[o + 1])), F64(_f16(wr[o + 2], wr[o + 3]))
                    for c in range(4):
                        q, v, s0, s1 = o + 16 + 32 * c, 256 * b + 64 * c, np.int32(0), np.int32(0)
                        for k in range(32):
                            byte = np.int32(wr[q + k])
                            s0 = np.int32(s0 + (byte & 15) * np.int32(xq[t, v + k]))
                            s1 = np.int32(s1 + (byte >> 4) * np.int32(xq[t, v + 32 + k]))
                        j = 8 * b + 2 * c
                        sc0, m0 = _scale_min_k4(wr, o + 4, 2 * c)
                        sc1, m1 = _scale_min_k4(wr, o + 4, 2 * c + 1)
                        acc += d * sc0 * F64(dx[t, j]) * s0 - dmin * m0 * F64(xs[t, j])
                        acc += d * sc1 * F64(dx[t, j + 1]) * s1 - dmin * m1 * F64(xs[t, j + 1])
                out[t, r] = acc

    return quantize, q8_0, q4_k


def plain_kernel(name: str):
    """The kernel of `name` with its row compiled without fastmath (no reassociation: sums not vectorized)."""
    from numba import njit

    from colichat.engine.gguf import kernel_bodies, kernel_kquants

    bodies = kernel_kquants if kernels.block(name)[0] == 256 else kernel_bodies
    row = njit(getattr(bodies, f"_row_{name.lower()}").py_func)

    @njit(nogil=True)
    def matvec(w, x, xs, out):
        for r in range(w.shape[0]):
            for t in range(x.shape[0]):
                out[t, r] = row(w[r], x[t], xs[t])

    return matvec


def float32_kernel(name: str):
    """The matvec of `name` with float32 sums (kernel_bodies.py / kernel_kquants.py), compiled as kernels.py
    compiles the kept ones: what the type ran before its int8 products."""
    import numba

    from colichat.engine.gguf import kernel_bodies, kernel_kquants

    bodies = kernel_kquants if kernels.block(name)[0] == 256 else kernel_bodies
    return numba.njit(nogil=True)(getattr(bodies, f"matvec_{name.lower()}"))


def measure_variants(args) -> None:
    """Each type of kernels.INT8_ACTIVATIONS: its float32 sums against its int8 products (the kept kernel);
    for Q4_K and Q8_0 also the float32 sums without fastmath and int8 products in numba's own loops on bytes.
    Gparam/s on one thread and the worst error against float64 over sum |x| |W| (256 rows)."""
    rng = np.random.default_rng(1)
    R, Z = args.rows, args.cols
    x = rng.standard_normal((args.t, Z), dtype=np.float32)
    say(f"variants, {R} x {Z}, T = {args.t}, one thread: Gparam/s (wall, cpu), worst |error| / sum |x| |W|")
    for name in kernels.INT8_ACTIVATIONS:
        compare(name, random_rows(name, R, Z, rng), x, args)


def compare(name: str, w: np.ndarray, x: np.ndarray, args) -> None:
    from colichat.engine.gguf.kernel_bodies import sub_sums

    variants = [("float32 sums, fastmath reassoc", float32_kernel(name))]
    if name in ("Q4_K", "Q8_0"):
        quantize, int8_q8_0, int8_q4_k = int8_kernels()
        xs, plain = sub_sums(x, 32 if name == "Q4_K" else 0), plain_kernel(name)

        def with_int8(w, x, out):
            xq, dx = quantize(x)
            int8_q4_k(w, xq, dx, sub_sums(x, 32), out) if name == "Q4_K" else int8_q8_0(w, xq, dx, out)

        variants += [("float32 sums, no fastmath", lambda w, x, out: plain(w, x, xs, out)),
                     ("int8, numba's loops on bytes", with_int8)]
    variants.append(("int8, vector IR (kernels.matvec: kept)", lambda w, x, out: kernels.matvec(name, w, x, out)))
    W = np.empty((256, x.shape[1]), dtype=np.float32)
    kernels.dequantize(name, w[:256], W)
    want = x.astype(np.float64) @ W.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(W.T).astype(np.float64)
    for label, fn in variants:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        wall, cpu = timed(fn, w, x, out, args.repeat)
        p = w.shape[0] * x.shape[1] * x.shape[0]
        err = np.max(np.abs(out[:, :256] - want) / scale)
        say(f"  {name} {label:40} {p / wall / 1e9:6.2f} {p / cpu / 1e9:6.2f}   error {err:.1e}")


def timed(fn, w, x, out, repeat: int) -> tuple[float, float]:
    fn(w[:8], x, out[:, :8])  # compiled before the clock starts
    return best(lambda: fn(w, x, out), repeat)


START = """
import resource, sys, time
c0 = time.process_time()
import numba
c1 = time.process_time()
from colichat.engine.gguf import kernels
c2, t = time.process_time(), time.perf_counter()
kernels.prepare(sys.argv[1])
c3, wall = time.process_time(), time.perf_counter() - t
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"prepare() {wall:.2f} s wall, {c3 - c2:.2f} s CPU here + {kids.ru_utime + kids.ru_stime:.2f} s CPU in its "
      f"helper process; import numba {c1 - c0:.2f} s CPU, colichat's engine {c2 - c1:.2f} s CPU")
"""


def measure_start(args) -> None:
    """The first start (compile every type) and later ones (numba's cache), each in a fresh process. On a
    quiet machine the first start's wall time is about the larger of its two CPU times."""
    with tempfile.TemporaryDirectory() as d:
        for label in ("first start (compiles)", "later start (cached)", "later start (cached)"):
            got = subprocess.run([sys.executable, "-c", START, d], capture_output=True, text=True)
            say(f"{label}: {got.stdout.strip() or got.stderr.strip()}")


def measure_attention(args) -> None:
    """One decode step's attention over every layer of SmolLM2's shape (30 layers, G 3, J 3, E 64), rows in the
    cache's record layout (engine/cache.py), at each context: numpy's gqa_attention against the compiled one
    on 1 thread and on 2 (the engine's threads sharing its parts), ms a token; after reading 256 MB of other
    memory (as the weights stream between a token's layers), and with one layer's rows read 30 times (in the
    CPU's caches)."""
    say("decode attention, SmolLM2's shape: ms a token (the best of --repeat), after 256 MB of other reads")
    other = np.ones(64 << 20, dtype=np.float32)
    for n in args.contexts:
        for name, times in attention_at(n, other, args.repeat).items():
            say(f"  {n} rows, {name}: {min(times) * 1e3:.2f} ms (median {sorted(times)[len(times) // 2] * 1e3:.2f})")


def attention_at(n: int, other: np.ndarray, repeat: int, layers: int = 30, g: int = 3, e: int = 64,
                 h: int = 9) -> dict:
    """measure_attention's seconds a token at n cache rows, each way `repeat` times."""
    from colichat.engine.attention import gqa_attention
    from colichat.engine.ops import run_blocks
    from colichat.engine.threads import Workers

    rng, workers = np.random.default_rng(0), Workers(2)
    record = np.dtype([("token", "<i4"), ("kv", "<f4", (layers, 2 * g * e))])
    rows = np.zeros(n, dtype=record)
    rows["kv"] = rng.standard_normal((n, layers, 2 * g * e), dtype=np.float32)
    k = [rows["kv"][:, l, : g * e] for l in range(layers)]  # (N, G*E) strided views, as the cache's
    v = [rows["kv"][:, l, g * e :] for l in range(layers)]
    q = rng.standard_normal((1, h + g, e), dtype=np.float32)[:, :h]  # (1, H, E) as the layer's view

    def two(compute, parts):
        run_blocks(compute, lambda i, _: None, parts, workers)

    ways = {"numpy": lambda l: gqa_attention(q, k[l].reshape(n, g, e), v[l].reshape(n, g, e), n - 1, 0.125),
            "compiled, 1 thread": lambda l: kernels.gqa_rows(q, k[l], v[l], n - 1, 0.125),
            "compiled, 2 threads": lambda l: kernels.gqa_rows(q, k[l], v[l], n - 1, 0.125, two),
            "compiled, one layer's rows (in cache)": lambda l: kernels.gqa_rows(q, k[0], v[0], n - 1, 0.125)}
    out = {}
    for name, one in ways.items():
        out[name] = []
        for _ in range(repeat):
            other.sum()
            t0 = time.perf_counter()
            for l in range(layers):
                one(l)
            out[name].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=list(kernels.TYPES))
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--t", type=int, default=1, help="rows of x (1: decode; up to 16)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--numpy", action="store_true", help="also numpy's f32 matvec on the dequantized matrix")
    ap.add_argument("--start", action="store_true", help="measure the first compile and a cached start")
    ap.add_argument("--variants", action="store_true", help="each int8 type's float32 sums against its int8 products")
    ap.add_argument("--attention", action="store_true", help="decode's attention: numpy's against the compiled one")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4000], help="cache rows (--attention)")
    args = ap.parse_args()
    if args.attention:
        kernels.prepare(None, names=[])
        measure_attention(args)
        return
    if args.start:
        measure_start(args)
        return
    kernels.prepare(None, names=args.types)
    measure_variants(args) if args.variants else measure_types(args)


if __name__ == "__main__":
    main()
