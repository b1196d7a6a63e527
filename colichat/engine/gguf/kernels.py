"""Compiled kernels on GGUF blocks read in place: y = W x for the rows of x, and dequantized tiles.

    problem()                       None, or one line: why the kernels cannot run here (the engine then
                                    uses its numpy path, `--kernels numpy`)
    prepare(cache_dir, progress)    compile every kernel once (or load it from numba's cache under
                                    <cache_dir>/kernels); the seconds it took
    supported("Q4_K"), block("Q4_K") -> (256, 144)   values and bytes per block
    matvec(name, w, x, out)         out (T, R) = x (T, Z) times dequant(w (R, row_bytes)).T, for T that
                                    takes(name, T) allows (1..16; any T for the K-quants, 128-256 for Q8_0 ...)
    rounded(name, x)                x as the type's matvec takes it (INT8_ACTIVATIONS: its 8-bit rounding,
                                    computed once for every row block of a product)
    dequantize(name, w, out)        out (R, Z) = dequant(w): gguf-py's values, bit for bit
    gqa_rows(q, k, v, pos0, scale)  decode's and verify passes' GQA attention over the cache's rows
                                    (kernel_attention.py)

The bodies are in kernel_bodies.py, kernel_kquants.py and kernel_int8.py (numba `njit`, nogil): plain loops over the
bytes of each block as ggml lays them out (their comments; gguf-py's gguf.quants). A K-quant matvec works
on each block's sub-blocks: the integer codes times x summed in float32 (vectorized), the sub-block's
scale applied once to that sum, and a minimum through the per-sub-block sums of x, computed once per
call and shared by every row; blocks add into float64. The 32-value types (Q8_0, Q4_0, ...) sum in 32
float32 lanes across the row's blocks instead (what LLVM vectorizes for them: 3x faster on Q8_0).
The types of INT8_ACTIVATIONS (every quantized type: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_XS) round x to 8 bits per block instead, as llama.cpp does, and take integer dot products
that kernel_int8.py emits as vector IR (one vpdpbusd per 32 codes on a CPU with VNNI, 4 rows of x sharing
each block's unpacked codes): 3-27x faster than their float32 sums, at llama.cpp's accuracy, and faster
than a dequantized tile's sgemm for a prefill (MOST_ROWS). The float32 sums remain the matvec of F32, F16
and BF16, and a variant benchmarks/kernels.py --variants measures. (numba's own loops on bytes widen to
int64: no faster than float32.)

Contract:
- w: C-contiguous rows of whole blocks, uint8 (or the float dtype gguf-py gives F32/F16 tensors: viewed
  as bytes), a view of the file's memory map: never copied, never written. x: float32 (T, Z), Z the
  row's values. out: float32 of the stated shape, any strides (a column range of a larger out is fine).
- Each out[t, r] comes from w[r] and x[t] alone, summed in one fixed order, so its bits do not depend
  on T, on how the rows are split between calls, or on the thread count.
- x may be rounded(name, x) instead (its rounding kind must be the type's).
- nogil: the engine's own threads call matvec on disjoint row ranges at once (the one threading
  scheme; numba's prange is not used).
- Accuracy: |out - x W.T| <= 1e-5 * sum |x| |W| (float64 reference on the dequantized W); for
  INT8_ACTIVATIONS, plus x's rounding: half of x's block scale times sum |W| over each block.

Measured (benchmarks/kernels.py, 2026-12-07, a quiet 2-core Zen 4 with AVX-512 VNNI): matvec Gparam/s on one
thread, 4096 x 4096, T 1, the int8 products (20:00): Q6_K 32.2, Q4_K 31.0, Q8_0 30.2, Q5_K 28.2, Q4_0 26.9,
Q5_0 20.4, Q4_1 20.1, Q5_1 16.5; (22:10) Q2_K 33.9, IQ4_XS 26.9, Q3_K 26.6, IQ4_NL 21.3 (their float32
sums: 1.3, 1.0, 3.1, 1.8); the float32 sums (17:40): F32 5.0, BF16 2.6, F16 2.4. First start, every type:
8.8 s (half the types compiled in a helper process; 22:55, one row intrinsic a type for any count of x's rows);
a later start: 0.22-0.23 s in prepare(), plus 0.4 s to import numba.

State: one module-level cache, _COMPILED, of the compiled functions by type name (and the reason a
compile failed); everything else here is constant tables.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HELPER_WAIT = 300  # seconds prepare() waits for its compiling helper process before doing its share itself
SMALL_BATCH = 16  # the most rows of x a matvec takes (decode and speculative verify passes)
TYPES = {  # GGUF type name -> (values per block, bytes per block)
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_XS": (256, 136),
}

# matvec rounds x to 8 bits (Q8_0 per 32 values, Q8_K per 256) and takes integer dot products (kernel_int8.py)
INT8_ACTIVATIONS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K")
# The most rows of x a matvec takes: SMALL_BATCH, or for INT8_ACTIVATIONS about where a dequantized tile's sgemm
# becomes faster (benchmarks/kernels.py; 1 thread, 4096 x 4096; None: never, up to T 512 measured).
MOST_ROWS = {"Q8_0": 256, "Q4_0": 256, "Q4_1": 128, "Q5_0": 256, "Q5_1": 128, "Q4_K": None, "Q5_K": None, "Q6_K": None,
             "IQ4_NL": 128, "IQ4_XS": 128, "Q2_K": 128, "Q3_K": 256}


ATTENTION = "attention"  # prepare()'s name for the compiled GQA attention (kernel_attention.py), beside the types


class _Compiled:
    """The compiled (matvec, dequantize) of each type name, the attention, and why compiling failed, if it did."""

    def __init__(self):
        self.functions: dict[str, tuple] = {}
        self.attention = None  # kernel_attention.gqa_rows, compiled
        self.roundings: dict[str, object] = {}  # "q8_k", "q8_0": x's 8-bit rounding (INT8_ACTIVATIONS)
        self.failure: str | None = None


_COMPILED = _Compiled()


def problem() -> str | None:
    """None when the compiled kernels can run here; else one line saying why not (numba missing, a compile
    that failed): the engine then falls back to its numpy path (`--kernels numpy`)."""
    if _COMPILED.failure:
        return _COMPILED.failure
    try:
        import numba  # noqa: F401
    except ImportError as e:
        return f"numba cannot be imported ({e}): the numpy path is used"
    return None


def supported(qtype_name: str) -> bool:
    return qtype_name in TYPES


def block(qtype_name: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type name such as "Q4_K"."""
    return TYPES[qtype_name]


def _signatures():
    """numba's signatures: (matvec, dequantize, the product on x's 8-bit rounding (qx, dx, sums), the
    roundings)."""
    from numba import types as nt

    w = nt.Array(nt.uint8, 2, "C", readonly=True)
    x = nt.Array(nt.float32, 2, "C", readonly=True)
    out = nt.Array(nt.float32, 2, "A")
    qx, dx, bsums = (nt.Array(t, 2, "C", readonly=True) for t in (nt.int8, nt.float32, nt.int32))
    result = nt.Tuple([nt.Array(a.dtype, 2, "C") for a in (qx, dx, bsums)])
    return nt.void(w, x, out), nt.void(w, out), nt.void(w, qx, dx, bsums, out), result(x)


def cache_path(cache_dir: str | None) -> str | None:
    """<cache_dir>/kernels (or NUMBA_CACHE_DIR, numba's own variable, where it is set: one cache that several
    homes share, as the tests do), created, when it can be written; else None (compile without a disk cache)."""
    if cache_dir is None:
        return None
    path = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(cache_dir, "kernels")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK | os.X_OK) else None


def _compile(names, path: str | None, progress=None, done: int = 0, total: int = 0) -> None:
    """Compile the kernels of `names` into _COMPILED, kept in (or loaded from) numba's cache at `path`
    (None: not kept). numba reads its CACHE_DIR when a function is decorated: it is set around that only."""
    import numba
    from numba.core.errors import NumbaError

    from . import kernel_attention, kernel_bodies, kernel_int8, kernel_kquants

    mv_sig, dq_sig, product_sig, rounding_sig = _signatures()
    saved = numba.config.CACHE_DIR
    try:
        numba.config.CACHE_DIR = path or saved
        for name in names:
            if name == ATTENTION:
                part_sig, merge_sig = kernel_attention.signatures()
                _COMPILED.attention = (
                    numba.njit(part_sig, nogil=True, cache=path is not None)(kernel_attention.gqa_part),
                    numba.njit(merge_sig, nogil=True, cache=path is not None)(kernel_attention.gqa_merge))
                done += 1
                if progress is not None:
                    progress(done, total or len(names))
                continue
            key, bodies = name.lower(), kernel_kquants if TYPES[name][0] == 256 else kernel_bodies
            dq = numba.njit(dq_sig, nogil=True, cache=path is not None)(getattr(bodies, f"dequant_{key}"))
            if name in INT8_ACTIVATIONS:
                kind = rounding(name)
                mv = numba.njit(product_sig, nogil=True, cache=path is not None)(
                    getattr(kernel_int8, f"product_{key}"))
                if kind not in _COMPILED.roundings:
                    _COMPILED.roundings[kind] = numba.njit(rounding_sig, nogil=True, cache=path is not None)(
                        getattr(kernel_int8, kind))
            else:
                mv = numba.njit(mv_sig, nogil=True, cache=path is not None)(getattr(bodies, f"matvec_{key}"))
            _COMPILED.functions[name] = (mv, dq)
            done += 1
            if progress is not None:
                progress(done, total or len(names))
    except NumbaError as e:
        _COMPILED.failure = f"the compiled kernels failed to compile ({str(e).splitlines()[0]}): the numpy path is used"
    finally:
        numba.config.CACHE_DIR = saved


def cached(cache_dir: str | None, names) -> bool:
    """Whether numba's cache under <cache_dir>/kernels holds the kernels of every type `names` (prepare()
    then loads them: well under a second; else it compiles: a first start's seconds, worth saying)."""
    path = None if problem() is not None else cache_path(cache_dir)
    return path is not None and all(os.path.exists(_stamp(path, n)) for n in [*names, ATTENTION])


def _stamp(path: str, name: str) -> str:
    """The file that says type `name`'s kernels of this source, numba and Python are in the cache at
    `path` (so that a later start needs no helper process)."""
    import numba

    h = hashlib.sha256(f"{numba.__version__} {sys.version}".encode())
    for module in ("kernel_bodies.py", "kernel_kquants.py", "kernel_int8.py", "kernel_attention.py"):
        h.update(Path(__file__).with_name(module).read_bytes())
    return os.path.join(path, f"{name}-{h.hexdigest()[:16]}.done")


def _compile_beside(path: str, names: list[str]):
    """A process compiling `names` into numba's cache at `path` while this one compiles the others: the
    first start takes about half as long on two cores. None if it cannot be started."""
    root = str(Path(__file__).resolve().parents[3])  # the directory colichat is imported from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    code = "import sys; from colichat.engine.gguf import kernels; kernels._compile(sys.argv[2:], sys.argv[1])"
    try:
        return subprocess.Popen([sys.executable, "-c", code, path, *names], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def prepare(cache_dir: str | None, progress=None, names=None) -> float:
    """Compile (or load from numba's on-disk cache kept under <cache_dir>/kernels; a read-only cache
    directory compiles without keeping) every kernel once, or those of the type `names` given (a file's);
    returns the seconds it took. progress(done, total) is called after each type. After a failure,
    problem() says what failed. A first start with a cache compiles half the types in a second process
    (into the cache, then loaded here); a stamp file per type says it is in the cache."""
    start = time.perf_counter()
    if problem() is None:
        todo = [n for n in (names or TYPES) if n not in _COMPILED.functions]
        todo = ([ATTENTION] if _COMPILED.attention is None else []) + todo  # (first: here, a type beside it)
        path = cache_path(cache_dir)
        helper = None
        cached = path is not None and all(os.path.exists(_stamp(path, n)) for n in todo)
        if path is not None and len(todo) > 1 and (os.cpu_count() or 1) > 1 and not cached:
            helper = _compile_beside(path, todo[1::2])
        mine = todo if helper is None else todo[0::2]
        try:
            _compile(mine, path, progress, 0, len(todo))
            if helper is not None:
                helper.wait(timeout=HELPER_WAIT)
        except subprocess.TimeoutExpired:
            pass  # its share is compiled here
        finally:
            if helper is not None and helper.poll() is None:
                helper.kill()
                helper.wait()
        if helper is not None:
            _compile(todo[1::2], path, progress, len(mine), len(todo))
        for n in todo if path is not None and not cached and problem() is None else ():
            Path(_stamp(path, n)).touch()
    return time.perf_counter() - start


def _functions(qtype_name: str) -> tuple:
    f = _COMPILED.functions.get(qtype_name)
    if f is None:  # not prepared: compiled now, without a disk cache
        _compile([qtype_name], None)
        f = _COMPILED.functions[qtype_name]
    return f


def _bytes(qtype_name: str, w: np.ndarray, z: int) -> np.ndarray:
    """w as its (R, row_bytes) uint8 (a view: gguf-py gives F32 and F16 tensors as float arrays)."""
    values, size = TYPES[qtype_name]
    if w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError("w must be C-contiguous rows (R, row_bytes)")
    w = w.view(np.uint8)
    if w.shape[1] % size or w.shape[1] // size * values != z:
        raise ValueError(f"{qtype_name} rows of {w.shape[1]} bytes do not hold {z} values")
    return w


def rounding(qtype_name: str) -> str | None:
    """How the type's matvec rounds x: "q8_k" (per 256 values, with the sums of qx over each 16), "q8_0" (per
    32, with the sums of qx over each 32), or None (float32 sums)."""
    if qtype_name not in INT8_ACTIVATIONS:
        return None
    return "q8_k" if TYPES[qtype_name][0] == 256 else "q8_0"


def takes(qtype_name: str, t: int) -> bool:
    """Whether matvec takes t rows of x for this type (else: dequantized tiles and sgemm, for a prefill)."""
    most = MOST_ROWS.get(qtype_name, SMALL_BATCH)
    return 1 <= t and (most is None or t <= most)


def rounded(qtype_name: str, x: np.ndarray):
    """x (T, Z) float32 as the type's matvec takes it: for INT8_ACTIVATIONS its 8-bit rounding (qx, dx, sums),
    computed once for every row block of a product (the same for every type of a rounding); else x."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype_name not in INT8_ACTIVATIONS:
        return x
    kind = rounding(qtype_name)
    _functions(qtype_name)
    return (kind, *_COMPILED.roundings[kind](x))


def matvec(qtype_name: str, w: np.ndarray, x, out: np.ndarray) -> None:
    """out (T, R) float32 = x (T, Z) float32 times dequant(w).T, where w (R, row_bytes) uint8 are R whole
    rows of a GGUF tensor (a read-only view into the file's memory map: never copied) and T is 1..16
    (decode and speculative verify passes), or any count takes() allows. x may be given as rounded(x) (a
    product split into row blocks rounds x once). Releases the GIL (njit nogil): the engine's own Python
    threads call it on disjoint row ranges. Each out[t, r] is computed from w[r] and x[t] alone in a
    fixed order, so the bits do not depend on T, on how the rows are split, or on the thread count."""
    if isinstance(x, np.ndarray):
        x = rounded(qtype_name, x)
    elif qtype_name not in INT8_ACTIVATIONS or x[0] != rounding(qtype_name):
        raise ValueError(f"x rounded as {x[0]} is not what {qtype_name}'s matvec takes")
    t, z = x.shape if isinstance(x, np.ndarray) else x[1].shape
    w = _bytes(qtype_name, w, z)
    if not takes(qtype_name, t) or out.dtype != np.float32 or out.shape != (t, w.shape[0]):
        most = MOST_ROWS.get(qtype_name, SMALL_BATCH) or "any"
        raise ValueError(f"{qtype_name}'s matvec takes x (T, Z), T 1..{most}, and out (T, R) float32")
    if isinstance(x, np.ndarray):
        _functions(qtype_name)[0](w, x, out)
    else:
        _functions(qtype_name)[0](w, *x[1:], out)


def gqa_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: float, run=None) -> np.ndarray:
    """The attention of T = 1..SMALL_BATCH query rows over a GQA cache (kernel_attention.py): q (T, H, E)
    float32 roped queries at positions pos0 .. pos0 + T - 1, k and v (N, G E) float32 cache rows (any row
    stride, the new rows written); returns (T, H E), row t over rows 0 .. pos0 + t. Computed by parts of
    kernel_attention.PART rows: run(compute, n) calls compute(i) for every i < n (default: in order, here;
    the engine's threads may share them, each releasing the GIL), then the parts are merged in order: the same
    bits however they were shared."""
    from . import kernel_attention

    t, h, e = q.shape
    if not (1 <= t <= SMALL_BATCH and e % 8 == 0 and k.shape[1] % e == 0 and h % (k.shape[1] // e) == 0
            and k.shape == v.shape and k.shape[0] >= pos0 + t and q.dtype == k.dtype == v.dtype == np.float32
            and q.strides[-1] == k.strides[-1] == v.strides[-1] == 4):
        raise ValueError("gqa_rows takes q (T, H, E), T 1..16, E a multiple of 8, and k, v (N, G E) float32 rows")
    if _COMPILED.attention is None:  # not prepared: compiled now, without a disk cache
        _compile([ATTENTION], None)
    part, merge = _COMPILED.attention
    n = kernel_attention.parts(pos0 + t)
    top, z, o = np.empty((t, n, h), np.float32), np.empty((t, n, h), np.float32), np.empty((t, n, h, e), np.float32)
    scale = np.float32(scale)

    def compute(i: int) -> None:
        part(q, k, v, pos0, scale, i, top, z, o)

    if run is None or n == 1:
        for i in range(n):
            compute(i)
    else:
        run(compute, n)
    out = np.empty((t, h * e), dtype=np.float32)  # (T, H*E)
    merge(top, z, o, out)
    return out


def dequantize(qtype_name: str, w: np.ndarray, out: np.ndarray) -> None:
    """out (R, Z) float32 = the values of the R rows w (R, row_bytes) uint8: compiled, nogil, for prefill
    tiles (dequantize a tile into a reused buffer, then numpy's sgemm). Bit for bit what dequant.py /
    gguf-py give."""
    w = _bytes(qtype_name, w, out.shape[1])
    if out.dtype != np.float32 or out.shape[0] != w.shape[0]:
        raise ValueError("dequantize takes out (R, Z) float32")
    _functions(qtype_name)[1](w, out)
