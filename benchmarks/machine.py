"""The machine's limits and what a token costs against them: the figures every benchmark is a fraction of.

measure_machine: memory read bandwidth (the best of numpy's sum over 1 GiB on one thread, the same split over
two threads, and an f32 matrix-vector product on two BLAS threads: what a decode token's weights can at best
be read at), f32 matvec in Gparam/s (numpy's own ceiling for a weight kept as f32), sgemm GFLOP/s. token_cost:
the quantized bytes and parameters of a GGUF a decode token reads. A decode's bound is the read bandwidth over
those bytes; a prefill's is sgemm over its FLOPs. roofline_terms: the same for a loaded model's f32 weights
(bench.py's rooflines). machine_info and code_version say what was measured, on what.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from common import OtherLoad, best_of, cell, gguf_header

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# --- the machine ----------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in cpu:
                cpu[key] = value.strip()
            if key == "flags" and "avx512" not in cpu:
                cpu["avx512"] = "avx512f" in value.split()
    except OSError:
        pass
    try:
        cpu["l3"] = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        pass
    blas = {}
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = {k: deps.get(k) for k in ("name", "version", "openblas configuration")}
    except Exception:  # the layout of show_config differs between numpy versions
        pass
    blas.update(openblas_runtime())
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "platform": platform.platform()}


def code_version() -> str:
    """The commit benchmarked, and whether the work tree had uncommitted changes to colichat/."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "colichat")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" + uncommitted changes to colichat/" if dirty else "")


def openblas_runtime() -> dict:
    """The kernel set and thread count numpy's bundled OpenBLAS chose on this machine (empty if not found)."""
    import ctypes

    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("libscipy_openblas*.so*")):
        try:
            so = ctypes.CDLL(str(lib))
            suffix = "64_" if "64" in lib.name else ""
            corename = getattr(so, f"scipy_openblas_get_corename{suffix}")
            corename.restype = ctypes.c_char_p
            threads = getattr(so, f"scipy_openblas_get_num_threads{suffix}")
            return {"openblas core": corename().decode(), "openblas threads": int(threads())}
        except (OSError, AttributeError):
            continue
    return {}


def measure_sgemm(n: int = 2048, reps: int = 8, threads: int | None = None) -> float:
    """GFLOP/s of a float32 n x n matmul (numpy, its BLAS, all its threads or `threads`)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with blas_threads(threads):
        best, _ = best_of(lambda: a @ b, reps)
    return 2 * n**3 / best / 1e9


def measure_matvec(n: int = 8192, reps: int = 12, threads: int | None = None) -> float:
    """GB/s of a float32 matrix-vector product whose matrix (n*n*4 bytes) is far larger than the caches (all
    BLAS threads or `threads`)."""
    rng = np.random.default_rng(1)
    m = rng.standard_normal((n, n), dtype=np.float32)
    x = rng.standard_normal((1, n), dtype=np.float32)
    with blas_threads(threads):
        best, _ = best_of(lambda: x @ m.T, reps)  # the engine's form: (1, D) @ (V, D).T
    return m.nbytes / best / 1e9


def measure_read(reps: int = 5) -> tuple[float, float]:
    """GB/s of numpy's sum over 1 GiB (touched first: no page faults) on one thread, and split over two."""
    a = np.ones(256 << 20, dtype=np.float32)
    halves = np.split(a, 2)
    with ThreadPoolExecutor(2) as pool:
        two = best_of(lambda: list(pool.map(np.sum, halves)), reps)[0]
    return a.nbytes / best_of(a.sum, reps)[0] / 1e9, a.nbytes / two / 1e9


def blas_threads(n: int | None):
    """A context that holds numpy's BLAS to n threads (n None: as it is)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(n, user_api="blas") if n else contextlib.nullcontext()


def measure_seq_read(path: Path, reps: int = 3, chunk: int = 16 << 20) -> float:
    """GB/s reading `path` from the page cache (read once to warm) with large reads into a
    preallocated, already touched buffer."""
    size = path.stat().st_size
    buf = np.ones(size, dtype=np.uint8)  # touched: no page faults while timing
    view = memoryview(buf)

    def read_all():
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:
                n = f.readinto(view[done : done + chunk])
                if not n:
                    break
                done += n

    best, _ = best_of(read_all, reps)
    return size / best / 1e9


def machine_limits(quick: bool) -> dict:
    with OtherLoad() as other:
        out = {"sgemm_gflops": measure_sgemm(reps=4 if quick else 8),
               "matvec_gbps": measure_matvec(reps=6 if quick else 12)}
    return {**out, "others_cpu": other.share}


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def sgemm_avx512_kernels() -> dict | None:
    """numpy's OpenBLAS may pick AVX2 (Haswell) kernels on a CPU that has AVX-512 (it does on AMD Zen 4/5):
    then measure sgemm once more in a child process with OPENBLAS_CORETYPE=SkylakeX, to show what the
    same library could do. None when not applicable."""
    core = openblas_runtime().get("openblas core", "")
    if not machine_info()["cpu"].get("avx512") or not core or core in AVX512_CORES:
        return None
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import machine, json; "
            "print(json.dumps({'core': machine.openblas_runtime().get('openblas core'), "
            "'sgemm_gflops': machine.measure_sgemm()}))")
    env = {**os.environ, "OPENBLAS_CORETYPE": "SkylakeX"}
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return {**json.loads(out.stdout), "default_core": core}
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def measure_machine(reps: int = 5) -> dict:
    """The limits a benchmark's figures are fractions of: read bandwidth (GB/s, the best of its probes, each
    kept: numpy's sum on 1 and 2 threads, f32 matvec on 2 BLAS threads), f32 matvec (GB/s on 1 and 2 BLAS
    threads, Gparam/s), sgemm 2048^3 on 2 BLAS threads (GFLOP/s)."""
    out = dict(zip(("read_sum_1", "read_sum_2"), measure_read(reps), strict=True))
    out.update(matvec_gbps_1=measure_matvec(reps=reps, threads=1), matvec_gbps_2=measure_matvec(reps=reps, threads=2),
               sgemm_gflops=measure_sgemm(reps=reps, threads=2))
    out["read_gbps"] = max(out["read_sum_1"], out["read_sum_2"], out["matvec_gbps_2"])
    out["matvec_gparams"] = max(out["matvec_gbps_1"], out["matvec_gbps_2"]) / 4
    return out


KERNEL_TYPES = ("Q4_K", "Q6_K", "Q8_0")  # the llama8b and V2-Lite-shaped files' types


def measure_kernels(rows: int = 14336, width: int = 4096, reps: int = 5) -> dict:
    """colichat's compiled matvec (colichat.engine.gguf.kernels) alone, per type of KERNEL_TYPES it has: a
    rows x width matrix of random blocks (llama8b's ffn_up: 33-62 MB, beyond the caches) times one row of x,
    on one thread and split into two row halves on two (the kernels release the GIL): Gparam/s. {} without
    the kernels; {"problem": why} where they cannot run. Compiled as the chat compiles them (numba's cache
    under colichat's cache directory: the first time takes minutes on a busy machine)."""
    try:
        from colichat.engine.gguf import kernels
    except ImportError:
        return {}
    from colichat.paths import paths

    if kernels.problem() is None:
        kernels.prepare(str(paths().cache))  # numba's cache where the chat keeps it
    if kernels.problem():
        return {"problem": kernels.problem()}
    with ThreadPoolExecutor(2) as pool:
        return {name: kernel_rate(kernels, name, rows, width, pool, reps) for name in KERNEL_TYPES
                if kernels.supported(name)}


def kernel_rate(kernels, name: str, rows: int, width: int, pool: ThreadPoolExecutor, reps: int) -> dict:
    """measure_kernels' figures of one type."""
    import gguf
    from gguf_factory import raw_blocks

    w = raw_blocks(0, "w", (rows, width), gguf.GGMLQuantizationType[name])  # (R, row bytes)
    x = np.random.default_rng(2).standard_normal((1, width), dtype=np.float32)  # (T, Z)
    out = np.zeros((1, rows), dtype=np.float32)  # (T, R)
    halves = [(w[a:b], out[:, a:b]) for a, b in ((0, rows // 2), (rows // 2, rows))]
    one = best_of(lambda: kernels.matvec(name, w, x, out), reps)[0]
    two = best_of(lambda: list(pool.map(lambda h: kernels.matvec(name, h[0], x, h[1]), halves)), reps)[0]
    return {"gparams_1": rows * width / one / 1e9, "gparams_2": rows * width / two / 1e9,
            "gbps_2": w.nbytes / two / 1e9}


def faster(a, b):
    """Figure by figure, the better of two measurements of the machine (the less disturbed one)."""
    if isinstance(a, dict):
        return {k: faster(v, b[k]) for k, v in a.items()}
    return max(a, b) if isinstance(a, float) else a


def machine_table(lim: dict) -> str:
    """The measured limits as a markdown table."""
    return ("| the machine, measured (the better of before and after the engines) | value |\n|---|---|\n"
            f"| memory read bandwidth: the best of sum 1 thread {lim['read_sum_1']:.1f}, sum 2 threads "
            f"{lim['read_sum_2']:.1f}, f32 matvec 2 BLAS threads {lim['matvec_gbps_2']:.1f} | "
            f"**{lim['read_gbps']:.1f} GB/s** |\n"
            f"| numpy f32 matvec (8192 x 8192, 256 MiB), 1 / 2 BLAS threads | {lim['matvec_gbps_1']:.1f} / "
            f"{lim['matvec_gbps_2']:.1f} GB/s = **{lim['matvec_gparams']:.2f} Gparam/s** |\n"
            f"| sgemm 2048^3, 2 BLAS threads | **{lim['sgemm_gflops']:.0f} GFLOP/s** |\n")


# --- what a token costs ---------------------------------------------------------------------------------


def token_cost(path: str | Path) -> dict:
    """What one decode token must read of a GGUF, in bytes and parameters: every tensor as stored but
    token_embd, of which one row (all of it where it is also the output head: no output.weight); of the
    routed experts (`*_exps`, shape (X, ..)) the share used ({arch}.expert_used_count / expert_count); and per
    context token the KV cache as llama.cpp keeps it (f16: K and V of every layer, or MLA's latent and rope
    key). Prefill FLOPs per token: 2 x the parameters but the output head's (a prefill takes the last
    token's logits only; attention's FLOPs left out)."""
    import gguf

    header = gguf_header(path)
    arch = header.kv.get("general.architecture", "")
    key = lambda k, d=0: header.kv.get(f"{arch}.{k}", d)  # noqa: E731
    used = key("expert_used_count") / max(1, key("expert_count", 1))
    tied = all(t.name != "output.weight" for t in header.tensors)
    by, params, out_head = 0.0, 0.0, 0
    for t in header.tensors:
        n = int(np.prod(t.shape, dtype=np.int64))
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.ggml_type)]
        row = t.name == "token_embd.weight" and not tied  # only the token's row is read
        share = 1.0 / t.shape[-1] if row else used if "_exps." in t.name else 1.0
        by += share * (n // block * size)
        params += share * n if len(t.shape) >= 2 and not row else 0
        out_head = n if t.name == ("token_embd.weight" if tied else "output.weight") else out_head
    n_layer, heads = key("block_count"), key("attention.head_count", 1)
    if key("attention.kv_lora_rank"):
        kv = 2 * n_layer * (key("attention.kv_lora_rank") + key("rope.dimension_count"))
    else:
        head_dim = key("attention.key_length", key("embedding_length") // heads)
        kv = 2 * 2 * n_layer * key("attention.head_count_kv", heads) * head_dim
    return {"weight_bytes": int(by), "params": int(params), "kv_bytes_per_token": int(kv),
            "prefill_flops": 2 * int(params - out_head)}


def decode_bound(cost: dict, lim: dict, ctx: int) -> float:
    """tok/s of a decode that reads the token's quantized weights and `ctx` cache rows at the read bandwidth."""
    return lim["read_gbps"] * 1e9 / (cost["weight_bytes"] + ctx * cost["kv_bytes_per_token"])


def prefill_bound(cost: dict, lim: dict) -> float:
    """tok/s of a prefill whose products run at the sgemm rate (attention left out)."""
    return lim["sgemm_gflops"] * 1e9 / cost["prefill_flops"]


def roofline_terms(model) -> dict:
    """What one token costs at least: bytes read by decode, FLOPs of prefill (see BENCHMARKS.md).

    decode bytes/token = every f32 weight array the token touches, read once: all layers' matrices
        and norms and the output matrix (the tied embedding for SmolLM2), plus one embedding row,
        plus the cache rows attention reads: n x L x (A+B) x 4 bytes at context n (for MLA: the
        latent c and the rope key of every cached token, once).
    prefill FLOPs for T tokens from an empty cache = 2 x T x (parameters of all layer matrices;
        for MLA attn_k_b/attn_v_b count once per token: decompressing its key and value)
        + 2 x V x D (logits of the last token only) + attention 2 x H x (d_qk + d_v) x T(T+1)/2 per layer
        (llama: d_qk = d_v = head size; MLA: d_qk = qk_nope + qk_rope, d_v = v head).
    """
    cfg, w = model.cfg, model.w
    other = sum(a.nbytes for k, a in w.items() if k not in ("token_embd", "output"))
    weight_bytes = other + model.output.nbytes + 4 * cfg.n_embd
    layer_params = sum(a.size for k, a in w.items() if k.startswith("blk.") and a.ndim >= 2)
    if model.cache.kind == "mla":
        d_qk, d_v = cfg.qk_nope + cfg.rope_dim, cfg.v_head_dim
    else:
        d_qk = d_v = cfg.head_dim
    return {"decode_weight_bytes": int(weight_bytes),
            "kv_bytes_per_ctx_token": int(model.cache.kv_bytes_per_token),
            "layer_params": int(layer_params),
            "output_flops": 2 * cfg.n_vocab * cfg.n_embd,
            "attn_pair_flops": 2 * cfg.n_head * (d_qk + d_v) * cfg.n_layer}


def decode_bytes(terms: dict, ctx: int) -> int:
    return terms["decode_weight_bytes"] + ctx * terms["kv_bytes_per_ctx_token"]


def prefill_flops(terms: dict, t: int) -> float:
    return 2.0 * t * terms["layer_params"] + terms["output_flops"] + terms["attn_pair_flops"] * t * (t + 1) / 2


def limits_table(cost: dict, lim: dict, c: dict, r: dict, decodes: list, prefills: list) -> str:
    """Each speed as a fraction of its limit, for both engines: decodes (key, label, context) against the read
    bandwidth over the bytes a token reads, and in Gparam/s (colichat's over llama.cpp's); prefills (key, label)
    against sgemm over the FLOPs a token costs."""
    gp = cost["params"] / 1e9
    rows = ["| against the machine's limit | bound | colichat | fraction | llama.cpp | fraction | colichat Gparam/s "
            "| llama.cpp Gparam/s | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for key, label, ctx in decodes:
        a, b, gb = c.get(key), r.get(key), (cost["weight_bytes"] + ctx * cost["kv_bytes_per_token"]) / 1e9
        bound = decode_bound(cost, lim, ctx)
        rows.append(f"| {label}, tok/s: {gb:.2f} GB a token at {lim['read_gbps']:.1f} GB/s | {bound:.3g} | "
                    f"{cell(a)} | {frac(a, bound)} | {cell(b)} | {frac(b, bound)} | {cell(a and a * gp)} | "
                    f"{cell(b and b * gp)} | {frac(a, b, '.3f')} |")
    for key, label in prefills:
        a, b, bound = c.get(key), r.get(key), prefill_bound(cost, lim)
        rows.append(f"| {label}, tok/s: {cost['prefill_flops'] / 1e9:.1f} GFLOP a token at "
                    f"{lim['sgemm_gflops']:.0f} GFLOP/s | {bound:.3g} | {cell(a)} | {frac(a, bound)} | "
                    f"{cell(b)} | {frac(b, bound)} | | | |")
    kern = lim.get("kernels") or {}
    if decodes and kern and "problem" not in kern:
        b = r.get(decodes[0][0])
        rows.append("\ncolichat's kernels alone, matvec of a 14336 x 4096 matrix, Gparam/s on 1 / 2 threads (2 "
                    "threads: GB/s of blocks read" + (", and over llama.cpp's decode Gparam/s" if b else "") + "): "
                    + "; ".join(f"{n} {k['gparams_1']:.2f} / {k['gparams_2']:.2f} ({k['gbps_2']:.1f} GB/s"
                                + (f", {k['gparams_2'] / (b * gp):.2f}x" if b else "") + ")" for n, k in kern.items()))
    elif "problem" in kern:
        rows.append(f"\ncolichat's kernels: {kern['problem']}")
    return "\n".join(rows) + (f"\n\nA token reads {cost['weight_bytes'] / 1e9:.2f} GB of the file's weights "
                              f"({gp:.2f} G parameters) plus {cost['kv_bytes_per_token']:,} bytes of f16 KV per "
                              f"context token; numpy's f32 matvec runs at {lim['matvec_gparams']:.2f} Gparam/s.\n")


def frac(a, b, fmt: str = ".0%") -> str:
    return f"{a / b:{fmt}}" if a and b else ""
