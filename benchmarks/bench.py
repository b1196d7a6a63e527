"""colichat benchmark: resume versus re-prefill, append cost, decode/prefill against the machine's limits.

    make bench                                    # both models, histories of 512, 2048 and 4096 tokens
    make bench ARGS="--quick"                     # 512 and 2048 only, fewer repetitions
    make bench ARGS="--skip-deepseek --publish"   # --publish also writes benchmarks/results.json, resume.png
    make bench ARGS="--plm"                       # also decode/prefill of a PLM-1.8B-shaped model (~9 GiB RAM)
    make bench ARGS="--dsa"                       # only: sparse attention (V3.2-shaped) vs dense, its verify passes
    make bench ARGS="--speculative-only"          # speculative decoding and threads only (speculative.py)
    make bench ARGS="--long-decode"               # only: decode at 64 and 4096 tokens, per-op profile (long_decode.py)
    make bench ARGS="--threads-only"              # the thread policy only (threads.py)

Everything is measured in one run on one machine and compared side by side; nothing here is asserted.
Two models: the default one (SmolLM2-135M, llama) and a random deepseek2 GGUF with DeepSeek-V2-Lite's
attention (27 layers, hidden 2048, 16 heads, kv_lora 512, qk_rope 64, qk_nope 128, v 128, no q_lora),
a dense SwiGLU FFN in every layer (width --ff, default 2816) and a 102400-token vocabulary, written
once as Q8_0 to benchmarks/out/ (git-ignored). With --plm (or --plm-only) a third model, PLM-1.8B's
layout and sizes (tests/gguf_factory.PLM_1_8B: plm, 32 layers, hidden 2048, 16 heads, kv_lora 512,
squared-ReLU FFN 8192, vocabulary 151936, 6.8 GiB as f32), is measured for decode and prefill against
the rooflines only. Sessions, weight caches and histories live in a temporary COLICHAT_HOME that is
removed at the end.

Timings of one repetition are taken with time.perf_counter; where a figure is repeated the best
repetition is reported (the machine may be shared: the best one is the least disturbed), and the
median is kept in the JSON. Output: a table on stdout, benchmarks/out/bench.json, bench.md, resume.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = HERE / "out"
sys.path.insert(0, str(REPO / "tests"))  # gguf_factory writes the deepseek2 model
sys.path.insert(0, str(HERE))
import long_decode  # noqa: E402  (benchmarks/long_decode.py: decode at 4096 tokens, per-op profile)
import speculative  # noqa: E402  (benchmarks/speculative.py: drafts, verify passes, threads)
import threads  # noqa: E402  (benchmarks/threads.py: the thread policy)

GEN_TOKENS = 64  # a turn: tokens generated, records appended
SHORT_CTX = 64  # "short context" for decode
PREFILL_TOKENS = 512  # prefill tok/s is measured on a prompt of this length
HEAD_ROOM = 256  # cache capacity beyond the longest history


# --- small helpers ------------------------------------------------------------------------------------


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def best_of(fn, reps: int) -> tuple[float, float]:
    """(best, median) seconds of `reps` calls of fn() (after one warm-up call)."""
    fn()
    times = [timed(fn)[0] for _ in range(reps)]
    return min(times), float(np.median(times))


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class OtherLoad:
    """How busy the other processes kept the CPUs during a measurement: their CPU seconds (all CPU time
    in /proc/stat minus this process's and its children's) over wall time x cores. 0 on a quiet machine;
    on 2 cores, 0.5 means another process held one core all along (then timings are not trustworthy)."""

    def __enter__(self) -> OtherLoad:
        self.t0, self.c0 = time.perf_counter(), self._others()
        self.share = 0.0
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        self.share = max(0.0, (self._others() - self.c0) / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0

    @staticmethod
    def _others() -> float:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return 0.0
        busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return busy - (me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime)


def fresh_cache(model) -> None:
    """Give the model a new, never-touched cache, as in a program that has just started."""
    from colichat.engine.cache import KVCache

    c = model.cache
    model.cache = KVCache(c.kind, c.n_layer, c.a_width, c.b_width, c.capacity, c.index_hd, c.n_index_layers)


# --- the machine --------------------------------------------------------------------------------------


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


def measure_sgemm(n: int = 2048, reps: int = 8) -> float:
    """GFLOP/s of a float32 n x n matmul (numpy, its BLAS, all its threads)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    best, _ = best_of(lambda: a @ b, reps)
    return 2 * n**3 / best / 1e9


def measure_matvec(n: int = 8192, reps: int = 12) -> float:
    """GB/s of a float32 matrix-vector product whose matrix (n*n*4 bytes) is far larger than the caches."""
    rng = np.random.default_rng(1)
    m = rng.standard_normal((n, n), dtype=np.float32)
    x = rng.standard_normal((1, n), dtype=np.float32)
    best, _ = best_of(lambda: x @ m.T, reps)  # the engine's form: (1, D) @ (V, D).T
    return m.nbytes / best / 1e9


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
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench, json; "
            "print(json.dumps({'core': bench.openblas_runtime().get('openblas core'), "
            "'sgemm_gflops': bench.measure_sgemm()}))")
    env = {**os.environ, "OPENBLAS_CORETYPE": "SkylakeX"}
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return {**json.loads(out.stdout), "default_core": core}
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


# --- models -------------------------------------------------------------------------------------------


def deepseek_gguf(n_ff: int, mtp: bool = False) -> Path:
    """The V2-Lite-shaped deepseek2 GGUF (dense FFN of width n_ff; with one dense MTP block if `mtp`),
    written once under benchmarks/out/."""
    from gguf_factory import V2_LITE_DENSE, write_deepseek2

    path = OUT / f"v2lite-dense-ff{n_ff}{'-mtp' if mtp else ''}.gguf"
    extra = {"n_nextn": 1, "n_dense": V2_LITE_DENSE.n_layer + 1} if mtp else {}
    if not path.exists():
        say(f"writing {path.name} (random Q8_0 weights)")
        tmp = path.with_suffix(".tmp.gguf")
        write_deepseek2(tmp, V2_LITE_DENSE, n_ff=n_ff, **extra)
        os.replace(tmp, path)
    return path


def plm_gguf() -> Path:
    """The PLM-1.8B-shaped GGUF, written once under benchmarks/out/."""
    from gguf_factory import PLM_1_8B, write_deepseek2

    path = OUT / "plm-1.8b.gguf"
    if not path.exists():
        say(f"writing {path.name} (random Q8_0 weights)")
        tmp = path.with_suffix(".tmp.gguf")
        write_deepseek2(tmp, PLM_1_8B)
        os.replace(tmp, path)
    return path


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


# --- measurements on a loaded model -------------------------------------------------------------------


def history_ids(model, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.cfg.n_vocab, n)


def measure_decode(model, n_tokens: int) -> tuple[float, float]:
    """(best, median) seconds per decoded token after what is in the cache."""
    rng = np.random.default_rng(7)
    times = [timed(model.decode, int(t))[0] for t in rng.integers(0, model.cfg.n_vocab, n_tokens)]
    return min(times), float(np.median(times))


def measure_rates(model, decode_tokens: int, prefill_reps: int, quick: bool) -> dict:
    """Prefill of PREFILL_TOKENS tokens (best of prefill_reps) and decode at SHORT_CTX, with the machine
    limits measured right before and after them (the rooflines use the better of the two)."""
    before = machine_limits(quick)
    ids = history_ids(model, PREFILL_TOKENS, seed=3)
    prefill = []
    with OtherLoad() as other:
        for _ in range(prefill_reps):
            fresh_cache(model)
            prefill.append(timed(model.prefill, ids, all_logits=False)[0])
        fresh_cache(model)
        model.prefill(ids[:SHORT_CTX], all_logits=False)
        best, median = measure_decode(model, decode_tokens)
    after = machine_limits(quick)
    return {"prefill_tokens": PREFILL_TOKENS, "prefill_s": min(prefill), "prefill_all_s": prefill,
            "decode_ctx": SHORT_CTX, "decode_s_per_token": best, "decode_median_s_per_token": median,
            "limits_before": before, "limits_after": after, "others_cpu": other.share,
            "limits": {k: max(before[k], after[k]) for k in ("sgemm_gflops", "matvec_gbps")}}


def reprefill(model, ids: np.ndarray, next_id: int, reps: int) -> dict:
    """Re-prefill: prefill the history (logits of the last token only) then decode one new token.
    The best of `reps` runs, each into a fresh cache."""
    runs = []
    for _ in range(reps):
        fresh_cache(model)
        t_prefill, _ = timed(model.prefill, ids, all_logits=False)
        t_decode, logits = timed(model.decode, next_id)
        runs.append({"prefill_s": t_prefill, "first_decode_s": t_decode, "total_s": t_prefill + t_decode})
    best = min(runs, key=lambda r: r["total_s"])
    return {**best, "all_total_s": [r["total_s"] for r in runs], "logits": logits}


def save_history(store, ident, layout, model, name: str, n: int):
    """A session holding the first n records of the model's cache (one turn), closed again."""
    from colichat.persist import Turn

    sess = store.create(ident, layout, name=name)
    try:
        sess.append(model.cache, [Turn("user", "history", 0, n)])
    finally:
        sess.close()
    return sess


def measure_append(store, ident, layout, model, n: int, reps: int) -> tuple[float, float]:
    """(best, median) seconds to append one turn of GEN_TOKENS records (fsyncs included) to a session
    already holding n records; after each, the turn is truncated away and appended again."""
    from colichat.persist import Turn

    sess = store.create(ident, layout, name=f"append-{n}")
    try:
        sess.append(model.cache, [Turn("user", "history", 0, n)])
        turn = Turn("assistant", "x" * 4 * GEN_TOKENS, n, n + GEN_TOKENS)
        times = []
        for _ in range(reps):
            times.append(timed(sess.append, model.cache, [turn])[0])
            sess.truncate(1)
    finally:
        sess.close()
    return min(times), float(np.median(times))


def measure_resume(store, ident, layout, model, name: str, next_id: int, reps: int, ref_logits) -> dict:
    """Reopen a saved session into a fresh cache and decode one token: open + load + decode.

    Also once into the cache that was just used (pages already touched), to show what page faults cost.
    """
    def once(fresh: bool):
        if fresh:
            fresh_cache(model)
        else:
            model.reset()
        t0 = time.perf_counter()
        sess = store.open(ident, name, layout)
        t1 = time.perf_counter()
        res = sess.load(model.cache, model.n_ctx, None)
        t2 = time.perf_counter()
        logits = model.decode(next_id)
        t3 = time.perf_counter()
        sess.close()
        if res.tokens != int(name.split("-")[-1]) or res.warnings:
            raise RuntimeError(f"resume of {name} loaded {res.tokens} tokens: {res.warnings}")
        return {"open_s": t1 - t0, "load_s": t2 - t1, "decode_s": t3 - t2, "total_s": t3 - t0}, logits

    runs, logits = [], None
    for _ in range(reps):
        r, logits = once(fresh=True)
        runs.append(r)
    warm, _ = once(fresh=False)
    best = min(runs, key=lambda r: r["total_s"])
    return {**best, "median_total_s": float(np.median([r["total_s"] for r in runs])),
            "open_load_s": min(r["open_s"] + r["load_s"] for r in runs),
            "warm_cache_open_load_s": warm["open_s"] + warm["load_s"],
            "logits_identical": bool(np.array_equal(logits, ref_logits))}


def bench_length(model, store, ident, layout, n: int, gen_reps: int, prefill_reps: int, reps: int) -> dict:
    """Every figure at one history length: re-prefill, decode at n, append cost, KV file, resume."""
    ids = history_ids(model, n)
    next_id = int(history_ids(model, 1, seed=99)[0])
    say(f"  {n} tokens: re-prefill")
    with OtherLoad() as other:
        rp = reprefill(model, ids, next_id, prefill_reps)
        ref_logits = rp.pop("logits")
        dec_best, dec_median = measure_decode(model, gen_reps)
    if model.cache.length < n + GEN_TOKENS:  # records for the appended turn (their content is irrelevant)
        model.prefill(history_ids(model, n + GEN_TOKENS - model.cache.length, seed=5), all_logits=False)
    say(f"  {n} tokens: append, resume")
    with OtherLoad() as other2:
        append_best, append_median = measure_append(store, ident, layout, model, n, reps=5)
        sess = save_history(store, ident, layout, model, f"hist-{n}", n)
        kv_path = Path(sess.kv_path)
        kv_bytes = kv_path.stat().st_size
        seq = measure_seq_read(kv_path)
        resume = measure_resume(store, ident, layout, model, f"hist-{n}", next_id, reps, ref_logits)
    return {
        "tokens": n,
        "others_cpu": {"prefill_decode": other.share, "append_resume": other2.share},
        "reprefill": rp,
        "decode_s_per_token": dec_best,
        "decode_median_s_per_token": dec_median,
        "decode_tokens_timed": gen_reps,
        "generate_turn_s": GEN_TOKENS * dec_best,
        "append_s": append_best,
        "append_median_s": append_median,
        "kv_file_bytes": kv_bytes,
        "kv_bytes_per_token": kv_bytes / n,
        "seq_read_gbps": seq,
        "resume": resume,
        "speedup": rp["total_s"] / resume["total_s"],
        "resume_read_gbps": kv_bytes / resume["open_load_s"] / 1e9,
        "resume_read_gbps_with_decode": kv_bytes / resume["total_s"] / 1e9,
    }


def bench_model(label: str, path: Path, lengths: list[int], quick: bool, gen_reps: int, prefill_reps: int) -> dict:
    """Every in-process figure of one model. gen_reps: tokens decoded per timing; prefill_reps: runs of
    each (re-)prefill, the best one counts."""
    from colichat.engine import load
    from colichat.persist import CacheLayout, Store, model_identity

    say(f"{label}: loading {path.name}")
    load_s, model = timed(load, str(path), n_ctx=max(lengths) + HEAD_ROOM)
    cfg = model.cfg
    terms = roofline_terms(model)
    ident = model_identity(str(path), cfg.arch, cfg.name)
    layout = CacheLayout.from_cache(model.cache, cfg.n_vocab)
    store = Store()
    rows = [bench_length(model, store, ident, layout, n, gen_reps, prefill_reps, reps=2 if quick else 3)
            for n in lengths]
    say(f"{label}: prefill and decode rates, machine limits around them")
    rates = measure_rates(model, max(gen_reps, 8), prefill_reps, quick)
    out = {"label": label, "path": str(path), "arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
           "n_vocab": cfg.n_vocab, "n_ff": cfg.n_ff, "weight_bytes": int(model.weight_bytes),
           "record_bytes": int(model.cache.record_bytes), "load_in_process_s": load_s, "roofline_terms": terms,
           "lengths": rows, "rates": rates}
    del model
    return out


def bench_rates_only(label: str, path: Path, quick: bool, decode_tokens: int = 8) -> dict:
    """Decode and prefill against the rooflines only (no histories, sessions or program starts): for a
    model too big to re-prefill long histories of in a benchmark run."""
    from colichat.engine import load

    say(f"{label}: loading {path.name}")
    load_s, model = timed(load, str(path), n_ctx=PREFILL_TOKENS + HEAD_ROOM)
    cfg = model.cfg
    say(f"{label}: prefill and decode rates, machine limits around them")
    out = {"label": label, "path": str(path), "arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
           "n_vocab": cfg.n_vocab, "n_ff": cfg.n_ff, "weight_bytes": int(model.weight_bytes),
           "record_bytes": int(model.cache.record_bytes), "load_in_process_s": load_s,
           "roofline_terms": roofline_terms(model), "lengths": [],
           "rates": measure_rates(model, decode_tokens, 1, quick)}
    del model
    return out


# Runs one command and reports its wall time and peak RSS. The go-between keeps the bench's own memory out
# of the figure: on Linux a child's ru_maxrss starts at its parent's RSS (the address space it was forked
# with counts until exec), and this small process is the parent instead of the bench with a model loaded.
LAUNCHER = """
import json, os, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = p.stderr.read()
_, status, usage = os.wait4(p.pid, 0)
print(json.dumps({"wall_s": time.perf_counter() - t0, "rc": os.waitstatus_to_exitcode(status),
                  "peak_rss_mib": usage.ru_maxrss / 1024, "stderr": err.decode("utf-8", "replace")}))
"""


def measure_start(model_path: Path | None, home: Path, *extra: str) -> dict:
    """One start of the real program: `python -m colichat.cli --plain [extra]` with stdin at end of file
    (pipe mode ends at once). Wall time to exit, what it printed on stderr, and its peak RSS."""
    cmd = [sys.executable, "-m", "colichat.cli", "--plain", *extra]
    if model_path is not None:
        cmd += ["--model", str(model_path)]
    env = {**os.environ, "COLICHAT_HOME": str(home)}
    out = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    if r["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r['rc']}: {r['stderr'].strip()[-500:]}")
    return {"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"], "stderr": r["stderr"].strip().splitlines()}


def measure_starts(model_path: Path | None, home: Path, label: str, lengths: list[int]) -> dict:
    """First start (empty weights cache: dequantize and write it), second start (map it), then one start
    per history length that resumes the session saved by the in-process runs (`--resume --session
    hist-N`): the resume time the program itself reports, in a process that has just started."""
    shutil.rmtree(home / "cache", ignore_errors=True)
    say(f"{label}: first and second start of colichat, then starts that resume")
    out = {"first": measure_start(model_path, home), "second": measure_start(model_path, home), "resumes": []}
    for n in lengths:
        r = measure_start(model_path, home, "--resume", "--session", f"hist-{n}")
        found = re.search(r"resumed (\d+) tokens.* in (\d+) ms", "\n".join(r["stderr"]))
        r.update(tokens=n, reported_ms=float(found.group(2)) if found else None)
        out["resumes"].append(r)
    return out


# --- derived figures, targets, table ------------------------------------------------------------------


def derive(model: dict, avx512: dict | None) -> dict:
    """Decode and prefill rates as fractions of the rooflines, from the limits measured around them
    (and, for prefill, also of the sgemm rate of OpenBLAS's AVX-512 kernels when numpy did not use them)."""
    terms, rates = model["roofline_terms"], model["rates"]
    gbps, gflops = rates["limits"]["matvec_gbps"], rates["limits"]["sgemm_gflops"]

    def decode_frac(ctx: int, s_per_token: float, others_cpu: float) -> dict:
        roof = decode_bytes(terms, ctx) / (gbps * 1e9)
        return {"ctx": ctx, "tok_s": 1 / s_per_token, "roofline_tok_s": 1 / roof, "fraction": roof / s_per_token,
                "others_cpu": others_cpu}

    t, seconds = rates["prefill_tokens"], rates["prefill_s"]
    roof_prefill = prefill_flops(terms, t) / (gflops * 1e9)
    out = {"decode_short": decode_frac(rates["decode_ctx"], rates["decode_s_per_token"], rates["others_cpu"])}
    if model["lengths"]:
        longest = max(model["lengths"], key=lambda r: r["tokens"])
        out["decode_long"] = decode_frac(longest["tokens"], longest["decode_s_per_token"],
                                         longest["others_cpu"]["prefill_decode"])
    return {
        **out,
        "prefill": {"tokens": t, "tok_s": t / seconds, "roofline_tok_s": t / roof_prefill,
                    "fraction": roof_prefill / seconds, "gflops": prefill_flops(terms, t) / seconds / 1e9,
                    "others_cpu": rates["others_cpu"],
                    "fraction_of_avx512_sgemm": (prefill_flops(terms, t) / seconds / 1e9 / avx512["sgemm_gflops"]
                                                 if avx512 else None)},
        "limits": rates["limits"],
    }


def targets(results: dict) -> list[dict]:
    out = []

    def add(name: str, measured: str, met: bool) -> None:
        out.append({"target": name, "measured": measured, "met": bool(met)})

    for m in results["models"]:
        lab = m["label"]
        r2k = next((r for r in m["lengths"] if r["tokens"] == 2048), None)
        if r2k:
            add(f"{lab}: resume at 2048 >= 100x faster than re-prefill",
                f"{r2k['speedup']:.0f}x ({r2k['resume']['total_s'] * 1e3:.0f} ms vs "
                f"{r2k['reprefill']['total_s']:.1f} s)", r2k["speedup"] >= 100)
            frac = r2k["resume_read_gbps"] / r2k["seq_read_gbps"]
            add(f"{lab}: resume read >= 1/2 of sequential read (2048)",
                f"{r2k['resume_read_gbps']:.2f} of {r2k['seq_read_gbps']:.2f} GB/s ({frac:.0%})", frac >= 0.5)
        if m["lengths"]:
            worst = max(m["lengths"], key=lambda r: r["append_s"] / r["generate_turn_s"])
            share = worst["append_s"] / worst["generate_turn_s"]
            add(f"{lab}: append a turn < 5% of generating it",
                f"worst {share:.1%} at {worst['tokens']} ({worst['append_s'] * 1e3:.1f} ms vs "
                f"{worst['generate_turn_s']:.2f} s)", share < 0.05)
        d = m["derived"]
        add(f"{lab}: decode >= 70% of matvec roofline (ctx {d['decode_short']['ctx']})",
            f"{d['decode_short']['fraction']:.0%} ({d['decode_short']['tok_s']:.1f} of "
            f"{d['decode_short']['roofline_tok_s']:.1f} tok/s)", d["decode_short"]["fraction"] >= 0.7)
        add(f"{lab}: prefill >= 50% of sgemm roofline ({d['prefill']['tokens']} tokens)",
            f"{d['prefill']['fraction']:.0%} ({d['prefill']['tok_s']:.0f} of "
            f"{d['prefill']['roofline_tok_s']:.0f} tok/s)", d["prefill"]["fraction"] >= 0.5)
        if lab == "SmolLM2-135M" and m.get("starts"):
            s = m["starts"]["second"]["wall_s"]
            add(f"{lab}: second start < 1 s to the prompt", f"{s:.2f} s", s < 1.0)
    return out


def table(headers: list[str], rows: list[list], markdown: bool) -> str:
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in cells])


def machine_line(results: dict) -> str:
    mi, cpu, blas, args = results["machine"], results["machine"]["cpu"], results["machine"]["blas"], results["args"]
    options = [f"--{k.replace('_', '-')}" for k, v in args.items() if v is True]
    options += [] if args["ff"] == 2816 else [f"--ff {args['ff']}"]
    return (f"{cpu.get('model name', '?')} (family {cpu.get('cpu family', '?')} model {cpu.get('model', '?')}, "
            f"AVX-512 {'yes' if cpu.get('avx512') else 'no'}, L3 {cpu.get('l3', '?')}), {mi['cores']} cores, "
            f"{mi['memory_gib']} GiB; Python {mi['python']}, numpy {mi['numpy']}, {blas.get('name', '?')} "
            f"{blas.get('version', '')} (kernels {blas.get('openblas core', '?')}, {blas.get('openblas threads', '?')} "
            f"threads); {mi['platform']}. Run of {results['date']} on colichat {results['code']}, "
            f"{results['run_s']:.0f} s, options: {' '.join(options) or 'none'}.")


def report(results: dict, markdown: bool) -> str:
    """All tables of a run, as plain text (stdout) or markdown (bench.md, BENCHMARKS.md)."""
    lim = results["limits"]
    parts = []
    title = (lambda s: f"\n### {s}\n") if markdown else (lambda s: f"\n== {s} ==")
    parts.append(title("Machine"))
    parts.append(machine_line(results))
    parts.append(title("Machine limits, measured in this run (the rooflines use the better of before/after)"))
    when = [("start of run", lim["start"]), ("end of run", lim["end"])]
    for m in results["models"]:
        when += [(f"{m['label']}: before rates", m["rates"]["limits_before"]),
                 (f"{m['label']}: after rates", m["rates"]["limits_after"])]
    rows = [[w, f"{x['sgemm_gflops']:.1f}", f"{x['matvec_gbps']:.1f}", f"{x['others_cpu']:.0%}"] for w, x in when]
    alt = lim.get("sgemm_avx512_kernels")
    if alt:
        rows.append([f"OPENBLAS_CORETYPE=SkylakeX ({alt['core']} kernels; default: {alt['default_core']})",
                     f"{alt['sgemm_gflops']:.1f}", "", ""])
    parts.append(table(["when", "sgemm 2048^2 f32 GFLOP/s", "matvec 8192^2 f32 GB/s", "other processes' CPU"],
                       rows, markdown))
    parts.append(title("Resume versus re-prefill (time to the first new token's logits)"))
    rows = []
    for m in results["models"]:
        for r in m["lengths"]:
            rs = r["resume"]
            rows.append([m["label"], r["tokens"], f"{r['kv_file_bytes'] / 1e6:.1f}", f"{r['kv_bytes_per_token']:,.0f}",
                         f"{rs['open_s'] * 1e3:.1f}", f"{rs['load_s'] * 1e3:.1f}", f"{rs['decode_s'] * 1e3:.1f}",
                         f"{rs['total_s'] * 1e3:.1f}", f"{r['reprefill']['total_s']:.2f}", f"{r['speedup']:.0f}x",
                         f"{r['resume_read_gbps']:.2f}", f"{r['seq_read_gbps']:.2f}",
                         f"{rs['warm_cache_open_load_s'] * 1e3:.1f}", "yes" if rs["logits_identical"] else "NO",
                         f"{max(r['others_cpu'].values()):.0%}"])
    parts.append(table(["model", "history", "KV MB", "KV B/token", "open ms", "load ms", "decode ms", "resume ms",
                        "re-prefill s", "speedup", "resume GB/s", "seq read GB/s", "load into used cache ms",
                        "same logits", "others' CPU"], rows, markdown))
    parts.append(title(f"Append one turn of {GEN_TOKENS} records vs generating it"))
    rows = [[m["label"], r["tokens"], f"{r['append_s'] * 1e3:.1f}", f"{r['append_median_s'] * 1e3:.1f}",
             f"{r['decode_s_per_token'] * 1e3:.1f}", f"{r['generate_turn_s']:.2f}",
             f"{r['append_s'] / r['generate_turn_s']:.2%}"] for m in results["models"] for r in m["lengths"]]
    parts.append(table(["model", "history", "append ms", "append median ms", "decode ms/token",
                        f"generate {GEN_TOKENS} s", "append share"], rows, markdown))
    parts.append(title("Decode and prefill against the rooflines"))
    rows = []
    for m in results["models"]:
        d = m["derived"]
        for key, what in (("decode_short", "decode"), ("decode_long", "decode"), ("prefill", "prefill")):
            if key not in d:
                continue
            x = d[key]
            ctx = f"ctx {x['ctx']}" if "ctx" in x else f"{x['tokens']} tokens"
            rows.append([m["label"], f"{what} {ctx}", f"{x['tok_s']:.1f}", f"{x['roofline_tok_s']:.1f}",
                         f"{x['fraction']:.0%}", f"{x['others_cpu']:.0%}"])
    parts.append(table(["model", "what", "tok/s", "roofline tok/s", "fraction", "others' CPU"], rows, markdown))
    notes = [f"{m['label']} prefill: {m['derived']['prefill']['gflops']:.0f} GFLOP/s = "
             f"{m['derived']['prefill']['fraction_of_avx512_sgemm']:.0%} of the AVX-512 kernels' sgemm"
             for m in results["models"] if m["derived"]["prefill"]["fraction_of_avx512_sgemm"]]
    if not markdown:
        notes.insert(0, "rooflines: decode bytes / matvec GB/s, prefill FLOPs / sgemm GFLOP/s (limits of the "
                        "'rates' rows above)")
    if markdown:
        parts.append("".join(f"\n{n}.\n" for n in notes))
    else:
        parts.append("\n".join(f"({n})" for n in notes))
    parts.append(title("Model load and program start"))
    rows = []
    for m in results["models"]:
        s = m.get("starts")
        starts = [f"{s[k]['wall_s']:.2f}" for k in ("first", "second")] if s else ["-", "-"]
        rss = [f"{s[k]['peak_rss_mib']:,.0f}" for k in ("first", "second")] if s else ["-", "-"]
        rows.append([m["label"], f"{m['weight_bytes'] / 2**20:,.0f}", f"{m['load_in_process_s']:.2f}",
                     starts[0], rss[0], starts[1], rss[1]])
    parts.append(table(["model", "f32 weights MiB", "load() s", "first start s", "first peak RSS MiB",
                        "second start s", "second peak RSS MiB"], rows, markdown))
    rows = [[m["label"], r["tokens"], f"{r['reported_ms']:.0f}" if r["reported_ms"] is not None else "?",
             f"{m['lengths'][i]['resume']['open_load_s'] * 1e3:.1f}", f"{r['wall_s']:.2f}",
             f"{m['starts']['second']['wall_s']:.2f}", f"{r['peak_rss_mib']:,.0f}"]
            for m in results["models"] if m.get("starts") for i, r in enumerate(m["starts"]["resumes"])]
    if rows:
        parts.append(title("Resume in a program that has just started (colichat --resume, as it reports)"))
        parts.append(table(["model", "history", "resume ms (program)", "open+load ms (in process, best)",
                            "start with resume s", "start without s", "peak RSS MiB"], rows, markdown))
    parts.append(title("Targets"))
    parts.append(table(["target", "measured", "met"],
                       [[t["target"], t["measured"], "met" if t["met"] else "NOT met"] for t in results["targets"]],
                       markdown))
    return "\n".join(parts) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, color in zip([m for m in results["models"] if m["lengths"]], ("tab:blue", "tab:red"), strict=False):
        n = [r["tokens"] for r in m["lengths"]]
        ax.plot(n, [r["reprefill"]["total_s"] for r in m["lengths"]], "o--", color=color,
                label=f"{m['label']}: re-prefill + 1 decode")
        ax.plot(n, [r["resume"]["total_s"] for r in m["lengths"]], "s-", color=color,
                label=f"{m['label']}: resume (open + load + 1 decode)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["lengths"], [str(n) for n in results["lengths"]])
    ax.set_yscale("log")
    ax.set_xlabel("history (tokens)")
    ax.set_ylabel("time to the first new token's logits (s)")
    ax.set_title("colichat: resume from disk vs re-prefill")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- sparse attention (DSA) ----------------------------------------------------------------------------

# DeepSeek-V3.2's attention and indexer (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, qk_rope 64,
# qk_nope 128, v 128; indexer 64 heads of 128, top_k 2048; YaRN factor 40 from 4096) in 2 layers with a
# dense FFN of 2048 and a 4096-token vocabulary (the real model: 61 layers, MoE, 129,280 tokens).
V32_SHAPED = dict(
    arch="deepseek32", n_layer=2, n_embd=7168, n_head=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128,
    qk_rope=64, v_head=128, n_ff=2048, n_dense=2, n_vocab=4096, context_length=163840, yarn_factor=40.0,
    yarn_orig_ctx=4096, yarn_log_mul=0.1, index_heads=64, index_dim=128, index_top_k=2048, qtype="Q8_0",
    raw_quant=True,
)
DSA_CONTEXTS = (512, 4096)
V32_REAL = dict(n_layer=61, kv_lora=512, qk_rope=64, index_hd=128)


def dsa_gguf() -> Path:
    from gguf_factory import DS2Spec, write_deepseek2

    path = OUT / "v32-shaped-2layers.gguf"
    if not path.exists():
        say(f"writing {path.name} (random Q8_0 weights)")
        tmp = path.with_suffix(".tmp.gguf")
        write_deepseek2(tmp, DS2Spec(**V32_SHAPED))
        os.replace(tmp, path)
    return path


def attention_only(n_ctx: int, reps: int) -> dict:
    """One decode query of one V3.2-shaped layer, attention alone (random arrays): dense absorbed MLA
    over n_ctx latent rows vs indexer scores over n_ctx Ic rows + top-2048 + absorbed MLA over the
    2048 gathered rows. Seconds, best of reps."""
    from colichat.engine import indexer as I
    from colichat.engine.attention import mla_absorbed

    rng = np.random.default_rng(0)
    h, c, r, dn, dv, hi, di, k = 128, 512, 64, 128, 128, 64, 128, 2048
    kv = rng.standard_normal((n_ctx, c + r), dtype=np.float32)
    ic = rng.standard_normal((n_ctx, di), dtype=np.float32)
    k_b = rng.standard_normal((h, c, dn), dtype=np.float32) / 20
    v_b = rng.standard_normal((h, dv, c), dtype=np.float32) / 20
    q_nope, q_pe = rng.standard_normal((1, h, dn), dtype=np.float32), rng.standard_normal((1, h, r), dtype=np.float32)
    qi, w = rng.standard_normal((1, hi, di), dtype=np.float32), rng.standard_normal((1, hi), dtype=np.float32)

    def dense():
        return mla_absorbed(q_nope, q_pe, kv, k_b, v_b, n_ctx - 1, 0.1)

    def sparse():
        idx = I.top_k_positions(I.indexer_scores(qi, w, ic, n_ctx - 1)[0], k)
        return mla_absorbed(q_nope, q_pe, kv[idx], k_b, v_b, idx.size - 1, 0.1)

    dense(), sparse()  # warm up; then alternate, so both see the same load
    times = [(timed(dense)[0], timed(sparse)[0]) for _ in range(reps)]
    return {"ctx": n_ctx, "dense_s": min(t[0] for t in times), "sparse_s": min(t[1] for t in times)}


def bench_dsa(quick: bool) -> dict:
    """Decode tok/s of the V3.2-shaped model at each context, with its indexer and with it off (the same
    model attending densely to every cached key), and the KV bytes per token with Ic. The cache rows
    before the decoded token (c, k_pe, Ic) are random: what decode costs does not depend on their values,
    and a real 4096-token prefill of this model takes minutes."""
    from colichat.engine import load

    path = dsa_gguf()
    sgemm_before = measure_sgemm(reps=4)
    say("sparse attention: loading the V3.2-shaped model")
    model = load(str(path), n_ctx=max(DSA_CONTEXTS) + 16)
    cfg, cache = model.cfg, model.cache
    n = max(DSA_CONTEXTS)
    rng = np.random.default_rng(3)
    cache.tokens[:n] = history_ids(model, n, seed=3)
    cache.records["kv"][:n] = rng.standard_normal(cache.records["kv"][:n].shape, dtype=np.float32)
    cache.records["ic"][:n] = rng.standard_normal(cache.records["ic"][:n].shape, dtype=np.float32)
    reps = 3 if quick else 6
    rows = []
    for ctx in DSA_CONTEXTS:
        say(f"sparse attention: decode at {ctx} tokens of context")
        times = {"sparse": [], "dense": []}
        with OtherLoad() as load_share:
            for i in range(reps + 1):  # the two alternate, so both see the same load; rep 0 warms up
                for mode in ("sparse", "dense"):
                    model.fwd.sparse = mode == "sparse"
                    cache.set_length(ctx)
                    times[mode].append(timed(model.decode, int(cache.tokens[i]))[0])
        row = {"ctx": ctx, "others_cpu": load_share.share}
        for mode, ts in times.items():
            row[mode] = {"s_per_token": min(ts[1:]), "median_s": float(np.median(ts[1:])), "tok_s": 1.0 / min(ts[1:])}
        rows.append(row)
    model.fwd.sparse = True
    say(f"sparse attention: verify passes of 1 + k tokens at {n} tokens of context")
    verify = {"ctx": n, "rows": speculative.bench_verify(model, n, reps, filled=True)}
    say("sparse attention: attention alone, one layer")
    alone = [attention_only(n, 3 if quick else 5) for n in (4096, 16384, 65536)]
    real = V32_REAL
    return {
        "spec": {k: v for k, v in V32_SHAPED.items() if k not in ("qtype", "raw_quant")},
        "weight_bytes": model.weight_bytes,
        "kv_bytes_per_token": model.cache.record_bytes,
        "kv_bytes_per_token_without_ic": 4 + 4 * cfg.n_layer * (cfg.kv_lora_rank + cfg.rope_dim),
        "real_v32_record_bytes": 4 + 4 * real["n_layer"] * (real["kv_lora"] + real["qk_rope"] + real["index_hd"]),
        "real_v3_record_bytes": 4 + 4 * real["n_layer"] * (real["kv_lora"] + real["qk_rope"]),
        "decode": rows,
        "verify": verify,
        "attention_alone": alone,
        "sgemm_gflops": {"before": sgemm_before, "after": measure_sgemm(reps=4)},
    }


def dsa_report(d: dict, markdown: bool) -> str:
    rows = [[r["ctx"], f"{r['sparse']['tok_s']:.2f}", f"{r['dense']['tok_s']:.2f}",
             f"{r['dense']['s_per_token'] / r['sparse']['s_per_token']:.2f}x", f"{r['others_cpu']:.0%}"]
            for r in d["decode"]]
    out = [table(["context", "decode tok/s, indexer (top_k 2048)", "decode tok/s, indexer off (dense)",
                  "speedup", "others' CPU"], rows, markdown)]
    v = d["verify"]
    out.append(f"verify pass of 1 + k tokens / one decode step ({v['ctx']} cached tokens, indexer on; decode "
               f"{v['rows'][0]['s'] * 1e3:.0f} ms): "
               + ", ".join(f"k={r['k']}: {r['vs_decode']:.2f}x" for r in v["rows"][1:]))
    rows = [[a["ctx"], f"{a['sparse_s'] * 1e3:.2f}", f"{a['dense_s'] * 1e3:.2f}",
             f"{a['dense_s'] / a['sparse_s']:.2f}x"] for a in d["attention_alone"]]
    out.append(table(["context", "indexer + top-k + attention over 2048 keys, ms", "dense attention, ms",
                      "ratio"], rows, markdown))
    out.append(f"KV bytes per token (record): {d['kv_bytes_per_token']:,} with Ic for this 2-layer model "
               f"({d['kv_bytes_per_token_without_ic']:,} without); DeepSeek-V3.2 (61 layers): "
               f"{d['real_v32_record_bytes']:,} with Ic vs {d['real_v3_record_bytes']:,} for V3. "
               f"f32 weights: {d['weight_bytes'] / 2**30:.2f} GiB. sgemm 2048^2 before/after: "
               f"{d['sgemm_gflops']['before']:.0f}/{d['sgemm_gflops']['after']:.0f} GFLOP/s.")
    return "\n\n".join(out) + "\n"


# --- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="histories of 512 and 2048 only, fewer repetitions")
    p.add_argument("--skip-deepseek", action="store_true", help="only the default model")
    p.add_argument("--ff", type=int, default=2816, help="dense FFN width of the deepseek2 model (default 2816)")
    p.add_argument("--no-starts", action="store_true", help="skip the program start measurements")
    p.add_argument("--no-speculative", action="store_true", help="skip speculative decoding and threads")
    p.add_argument("--speculative-only", action="store_true",
                   help="only speculative decoding and threads (benchmarks/speculative.py)")
    p.add_argument("--long-decode", action="store_true",
                   help="only decode at 64 and 4096 tokens of context with a per-op profile (long_decode.py)")
    p.add_argument("--threads-only", action="store_true",
                   help="only the thread policy: 1 thread, 2 on row blocks, OpenBLAS's 2 (benchmarks/threads.py)")
    p.add_argument("--plm", action="store_true",
                   help="also decode/prefill rates of a PLM-1.8B-shaped model (needs about 9 GiB of memory)")
    p.add_argument("--plm-only", action="store_true", help="only the machine limits and the PLM-1.8B-shaped rates")
    p.add_argument("--dsa", action="store_true",
                   help="only sparse attention (DeepSeek-V3.2-shaped model): indexer on vs off, verify passes")
    p.add_argument("--publish", action="store_true",
                   help="also write benchmarks/results.json and benchmarks/resume.png (the committed copies)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads_only:
        return threads.main(["--skip-deepseek"] * args.skip_deepseek + ["--ff", str(args.ff)])
    if args.speculative_only:
        flags = ["--quick"] * args.quick + ["--skip-deepseek"] * args.skip_deepseek
        return speculative.main(flags + ["--ff", str(args.ff)])
    if args.long_decode:
        return long_decode.main(["--skip-deepseek"] * args.skip_deepseek + ["--ff", str(args.ff)])
    if args.plm_only and args.publish:
        sys.exit("--publish replaces the published results of a full run; run --plm-only without it")
    lengths = [512, 2048] if args.quick else [512, 2048, 4096]
    OUT.mkdir(parents=True, exist_ok=True)
    if args.dsa:
        t0 = time.perf_counter()
        d = bench_dsa(args.quick)
        d.update(machine=machine_info(), date=time.strftime("%Y-%m-%d %H:%M:%S %z"), code=code_version(),
                 run_s=time.perf_counter() - t0)
        (OUT / "dsa.json").write_text(json.dumps(d, indent=1))
        (OUT / "dsa.md").write_text(dsa_report(d, markdown=True))
        print(dsa_report(d, markdown=False))
        print(f"run time {d['run_s']:.0f} s; wrote {OUT / 'dsa.json'}, dsa.md")
        return 0
    root = Path(tempfile.mkdtemp(prefix="colichat-bench-"))
    os.environ["COLICHAT_HOME"] = str(root / "home")  # sessions and weight caches of the in-process runs
    from colichat.models import default_model_path

    t_start = time.perf_counter()
    results = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "code": code_version(),
               "args": vars(args), "lengths": lengths, "models": []}
    try:
        say("machine limits")
        start = machine_limits(args.quick)
        avx512 = sgemm_avx512_kernels()
        # (label, GGUF, --model for the start measurement, tokens decoded per timing, prefill repetitions)
        models = [] if args.plm_only else [("SmolLM2-135M", Path(default_model_path()), None, 64,
                                             1 if args.quick else 2)]
        if not (args.skip_deepseek or args.plm_only):
            models.append((f"V2-Lite-shaped (FFN {args.ff})", deepseek_gguf(args.ff), "deepseek", 4, 1))
        for label, path, kind, gen_reps, prefill_reps in models:
            m = bench_model(label, path, lengths, args.quick, gen_reps, prefill_reps)
            if not args.no_starts:
                m["starts"] = measure_starts(path if kind else None, root / "home", kind or "default", lengths)
            results["models"].append(m)
        if not args.no_speculative:
            mtp = None if args.skip_deepseek or args.plm_only else deepseek_gguf(args.ff, mtp=True)
            results["speculative"] = speculative.run([(m[0], m[1]) for m in models], args.quick, mtp)
        if args.plm or args.plm_only:
            results["models"].append(bench_rates_only("PLM-1.8B-shaped", plm_gguf(), args.quick))
        say("machine limits again")
        end = machine_limits(args.quick)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["limits"] = {"start": start, "end": end, "sgemm_avx512_kernels": avx512}
    for m in results["models"]:
        m["derived"] = derive(m, avx512)
    results["targets"] = targets(results)
    results["run_s"] = time.perf_counter() - t_start

    (OUT / "bench.json").write_text(json.dumps(results, indent=1))
    (OUT / "bench.md").write_text(report(results, markdown=True))
    if any(m["lengths"] for m in results["models"]):
        plot(results, OUT / "resume.png")
    if args.publish:
        shutil.copy(OUT / "bench.json", HERE / "results.json")
        shutil.copy(OUT / "resume.png", HERE / "resume.png")
    print(report(results, markdown=False))
    if "speculative" in results:
        print(speculative.report(results["speculative"]))
    print(f"run time {results['run_s']:.0f} s; wrote {OUT / 'bench.json'}, bench.md, resume.png"
          + (" and benchmarks/results.json, resume.png" if args.publish else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
