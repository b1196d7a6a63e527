"""What the benchmarks share: timing, memory and CPU-share probes, the benchmark files (written once, as
streams), the engines each run in a child process of their own (colichat, and llama.cpp through --vs-llamacpp
PYTHON), and tables: side by side with ratios, plain or markdown. The machine's limits and what a token costs
against them are machine.py's.

Imports flow one way: the benchmark scripts import this module (and machine.py, which imports it); it imports
none of them. colichat is only imported inside functions: a llama.cpp child runs the same script under the
--vs-llamacpp python, which has numpy and llama-cpp-python 0.3.36 (../shared/tools/llamacpp/make-venv.sh prints
one) and nothing of colichat.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"  # git-ignored: bench.py's files and results
sys.path.insert(0, str(HERE.parent / "tests"))  # gguf_factory writes the benchmark files
GIB = 1 << 30
CHILD_THREADS = 2  # llama.cpp's n_threads and n_threads_batch


# --- probes ------------------------------------------------------------------------------------------


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def best_of(fn, reps: int) -> tuple[float, float]:
    """(best, median) seconds of `reps` calls of fn() after a warm-up call (the best: the least disturbed)."""
    fn()
    times = [timed(fn)[0] for _ in range(reps)]
    return min(times), float(np.median(times))


def best(fn, reps: int = 5) -> float:
    """Seconds of the fastest of `reps` calls of fn() after a warm-up call."""
    return best_of(fn, reps)[0]


def peak_rss() -> int:
    """This process's peak resident set (VmHWM: file pages it mapped and touched included), in bytes."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def cpu_mark() -> tuple[float, float, float]:
    """(wall seconds, busy seconds of all CPUs, CPU seconds of this process and its waited-for children) now."""
    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError):
        busy = 0.0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), busy, me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def others_share(a: tuple, b: tuple) -> float:
    """Share of the machine's CPUs other processes used between two cpu_marks: 0 on a quiet machine; on 2
    cores 0.5 means another process held a core all along (then timings are not trustworthy)."""
    wall = (b[0] - a[0]) * (os.cpu_count() or 1)
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall) if wall > 0 else 0.0


class OtherLoad:
    """`with OtherLoad() as o: ...` then o.share: others_share over the block."""

    def __enter__(self) -> OtherLoad:
        self.mark, self.share = cpu_mark(), 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.share = others_share(self.mark, cpu_mark())


# --- what a token costs, from the GGUF's header ----------------------------------------------------------


def gguf_header(path: str | Path):
    """The header of a GGUF (colichat's walker: keys but the tokenizer's, tensor infos)."""
    from colichat.engine.gguf.header import read_header

    with open(path, "rb") as f:
        return read_header(f.read(64 << 20), keep=lambda k: not k.startswith("tokenizer."))


def file_ok(path: Path, n_tensors: int) -> bool:
    """Whether `path` is a complete GGUF of n_tensors tensors: the last one's data within the file."""
    import gguf

    try:
        head = gguf_header(path)
        last = max(head.tensors, key=lambda t: t.offset)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(last.ggml_type)]
        end = head.data_start + last.offset + int(np.prod(last.shape, dtype=np.int64)) // block * size
        return len(head.tensors) == n_tensors and end <= path.stat().st_size
    except Exception:  # missing, short or not a GGUF: written again
        return False


def write_once(path: Path, write, n_tensors: int) -> Path:
    """`path`, written by write(part_path) first unless it is already a complete file (streamed to PATH.part,
    then renamed: an interrupted write is never taken for a file)."""
    if not file_ok(path, n_tensors):
        path.parent.mkdir(parents=True, exist_ok=True)
        say(f"writing {path} (random blocks)")
        t = time.perf_counter()
        write(path.with_suffix(".part"))
        os.replace(path.with_suffix(".part"), path)
        say(f"wrote {path.stat().st_size / 1e9:.1f} GB in {time.perf_counter() - t:.0f} s")
    return path


def deepseek_gguf(n_ff: int, mtp: bool = False) -> Path:
    """The V2-Lite-shaped deepseek2 GGUF (dense FFN of width n_ff; with one dense MTP block if `mtp`),
    written once under benchmarks/out/."""
    from gguf_factory import V2_LITE_DENSE

    extra = {"n_nextn": 1, "n_dense": V2_LITE_DENSE.n_layer + 1} if mtp else {}
    return deepseek2_file(OUT / f"v2lite-dense-ff{n_ff}{'-mtp' if mtp else ''}.gguf",
                          replace(V2_LITE_DENSE, n_ff=n_ff, **extra))


def plm_gguf() -> Path:
    """The PLM-1.8B-shaped GGUF, written once under benchmarks/out/."""
    from gguf_factory import PLM_1_8B

    return deepseek2_file(OUT / "plm-1.8b.gguf", PLM_1_8B)


def deepseek2_file(path: Path, spec) -> Path:
    """`path`: the gguf_factory DS2Spec `spec`, written once."""
    from gguf_factory import tensor_shapes, write_deepseek2

    return write_once(path, lambda part: write_deepseek2(part, spec), len(tensor_shapes(spec)))


# --- the engines, each in a child process -----------------------------------------------------------------


def run_child(cmd: list[str], env: dict | None = None) -> dict:
    """Run a child that prints its figures as JSON on its last stdout line; {"error": ...} if it fails."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        return {"error": f"{cmd[0]}: {e.strerror}"}
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout).strip()[-800:]}"}
    return json.loads(lines[-1])


def llamacpp(path: str, n_ctx: int, state_dir: str | None = None) -> SimpleNamespace:
    """llama.cpp (llama-cpp-python) for a benchmark's phases: only ever in the --vs-llamacpp python's process.
    prefill(ids) and decode(id) give the last token's logits (V,); fresh() an empty cache; save() writes the
    state (its KV cache and tokens) to a file under state_dir with llama_state_save_file, restore() reads it
    back into an emptied cache (llama_state_load_file)."""
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=CHILD_THREADS,
                n_threads_batch=CHILD_THREADS, verbose=False)
    state = str(Path(state_dir or ".") / "llamacpp.state").encode()

    def run(ids) -> np.ndarray:
        llm.eval(ids)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()  # (V,) the last token's

    def fresh() -> None:  # an emptied cache (eval drops the rows past n_tokens anyway)
        llm.reset()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)

    def save() -> int:
        n = llm.n_tokens
        ok = llama_cpp.llama_state_save_file(llm._ctx.ctx, state, (llama_cpp.llama_token * n)(*llm.input_ids[:n]), n)
        if not ok:
            raise RuntimeError("llama_state_save_file failed")
        return os.path.getsize(state)

    def restore() -> int:
        fresh()
        buf, got = (llama_cpp.llama_token * n_ctx)(), ctypes.c_size_t(0)
        if not llama_cpp.llama_state_load_file(llm._ctx.ctx, state, buf, n_ctx, ctypes.byref(got)):
            raise RuntimeError("llama_state_load_file failed")
        llm.input_ids[: got.value] = buf[: got.value]
        llm.n_tokens = got.value
        return got.value

    return SimpleNamespace(prefill=run, decode=lambda i: run([i]), fresh=fresh, save=save, restore=restore,
                           note=dict)


def colichat(path: str, n_ctx: int, state_dir: str | None = None, **load_args) -> SimpleNamespace:
    """colichat for a benchmark's phases (load_colichat).
    save() saves the cache as a session in a Store under state_dir; restore() opens it into a new, never
    touched cache, as `colichat --resume` in a program that has just started. model() gives the Model."""
    from colichat.persist import CacheLayout, Store, model_identity

    m, kernels_s = load_colichat(path, n_ctx, **load_args)
    store = Store(Path(state_dir or ".") / "sessions")
    ident = model_identity(path, m.cfg.arch, m.cfg.name)
    layout = CacheLayout.from_cache(m.cache, m.cfg.n_vocab)
    saved = []  # the sessions' names, the last one restored

    def save() -> int:
        saved.append(f"bench-{len(saved)}")
        sess = save_history(store, ident, layout, m, saved[-1], m.cache.length)
        return os.path.getsize(sess.kv_path)

    def restore() -> int:
        fresh_cache(m)
        sess = store.open(ident, saved[-1], layout)
        try:
            res = sess.load(m.cache, m.n_ctx, None)
        finally:
            sess.close()
        if res.warnings:
            raise RuntimeError(f"restore: {res.warnings}")
        return res.tokens

    def fresh() -> None:
        fresh_cache(m)

    return SimpleNamespace(prefill=lambda ids: m.prefill(ids, all_logits=False), decode=m.decode, fresh=fresh,
                           save=save, restore=restore, note=dict, model=lambda: m, kernels_s=kernels_s)


def load_colichat(path: str, n_ctx: int, **load_args):
    """(Model, seconds its compiled kernels took to be ready or None): as the chat starts, the kernels are
    compiled or taken from numba's cache under colichat's cache directory first (where the engine has
    them: engine.prepare_kernels), then engine.load, without a prepared-weights cache (what a first start
    reads)."""
    import colichat.engine as engine
    from colichat.paths import paths

    kernels_s = None
    if hasattr(engine, "prepare_kernels") and load_args.get("kernels", "numba") != "numpy":
        kernels_s = engine.prepare_kernels(path, paths().cache)
    return engine.load(path, n_ctx=n_ctx, **load_args), kernels_s


def fresh_cache(model) -> None:
    """Give the model a new, never-touched cache, as in a program that has just started."""
    from colichat.engine.cache import KVCache

    c = model.cache
    model.cache = KVCache(c.kind, c.n_layer, c.a_width, c.b_width, c.capacity, c.index_hd, c.n_index_layers)


def save_history(store, ident, layout, model, name: str, n: int):
    """A session of `store` holding the first n records of the model's cache (one turn), closed again."""
    from colichat.persist import Turn

    sess = store.create(ident, layout, name=name)
    try:
        sess.append(model.cache, [Turn("user", "history", 0, n)])
    finally:
        sess.close()
    return sess


def run_phases(out: dict, engine, steps: list, logits_dir: Path, name: str) -> None:
    """Run `steps`, (phase, fn, fresh first) each, fn() -> the last logits (V,), on one engine: per phase its
    seconds, the others' CPU share, finite logits, peak RSS so far, and engine.note(). Logits go to logits_dir
    as NAME-PHASE.npy (for the correlation of the two engines')."""
    for phase, fn, fresh in steps:
        if fresh:
            engine.fresh()
        a = cpu_mark()
        logits = np.asarray(fn(), dtype=np.float32).reshape(-1)  # (V,)
        b = cpu_mark()
        np.save(logits_dir / f"{name}-{phase}.npy", logits)
        out[phase] = {"s": b[0] - a[0], "others_cpu": others_share(a, b), "finite": bool(np.isfinite(logits).all()),
                      "rss": peak_rss(), **engine.note()}
    out["peak_rss"] = peak_rss()


# --- reports -------------------------------------------------------------------------------------------


def cell(v) -> str:
    return "-" if v is None else str(v) if isinstance(v, bool) else f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"


def table(headers: list[str], rows: list[list], markdown: bool) -> str:
    """Rows under headers: a markdown table, or plain text in right-aligned columns."""
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*headers), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in cells])


def side_by_side(figures: list, c: dict, r: dict | None) -> str:
    """A markdown table of figures (key, label, kind) for colichat (c) and llama.cpp (r): kind "rate" (higher is
    better), "time" or "size" (lower is better). The ratio is always colichat's over llama.cpp's in the sense of
    the target: speed for rates and times (a time's ratio is llama.cpp's time over colichat's), size for sizes."""
    head = "| figure | colichat |" + (" llama.cpp 0.3.36 | ratio (speed; memory: size) |\n|---|---|---|---|"
                                     if r is not None else "\n|---|---|")
    rows = [head]
    for key, label, kind in figures:
        a, b = c.get(key), (r or {}).get(key)
        row = f"| {label} | {cell(a)} |"
        if r is not None:
            ratio = None
            if isinstance(a, float) and isinstance(b, float) and a > 0 and b > 0:
                ratio = b / a if kind == "time" else a / b
            row += f" {cell(b)} | {'' if ratio is None else f'**{ratio:.3f}**'} |"
        rows.append(row)
    return "\n".join(rows) + "\n"


def kernels_note(run: dict) -> str:
    """What colichat's run says of its compiled kernels' start (load_colichat), as a sentence's end."""
    s = run.get("kernels_s")
    return "" if s is None else f"; its load includes {s:.1f} s of kernels made ready (numba's cache or a compile)"


def correlations(logits_dir: Path, stem: str, phases) -> str:
    """The correlation of colichat's last logits with llama.cpp's, per phase (where both were saved)."""
    out = []
    for p in phases:
        files = [logits_dir / f"{stem}-{e}-{p}.npy" for e in ("colichat", "llamacpp")]
        if all(f.exists() for f in files):
            out.append(f"{p} {np.corrcoef(*(np.load(f).astype(np.float64) for f in files))[0, 1]:.4f}")
    return ", ".join(out)
