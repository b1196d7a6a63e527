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
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dsa  # noqa: E402  (benchmarks/dsa.py: sparse attention)
import long_decode  # noqa: E402  (benchmarks/long_decode.py: decode at 4096 tokens, per-op profile)
import speculative  # noqa: E402  (benchmarks/speculative.py: drafts, verify passes, threads)
import threads  # noqa: E402  (benchmarks/threads.py: the thread policy)
from bench_report import derive, plot, report, targets  # noqa: E402
from common import OUT, OtherLoad, deepseek_gguf, fresh_cache, plm_gguf, save_history, say, timed  # noqa: E402
from machine import (  # noqa: E402
    code_version,
    machine_info,
    machine_limits,
    measure_seq_read,
    roofline_terms,
    sgemm_avx512_kernels,
)

GEN_TOKENS = 64  # a turn: tokens generated, records appended
SHORT_CTX = 64  # "short context" for decode
PREFILL_TOKENS = 512  # prefill tok/s is measured on a prompt of this length
HEAD_ROOM = 256  # cache capacity beyond the longest history


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
    """One start of the real program: `python -m colichat.terminal.cli --plain [extra]` with stdin at end of file
    (pipe mode ends at once). Wall time to exit, what it printed on stderr, and its peak RSS."""
    cmd = [sys.executable, "-m", "colichat.terminal.cli", "--plain", *extra]
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
        return dsa.main(["--quick"] * args.quick)
    root = Path(tempfile.mkdtemp(prefix="colichat-bench-"))
    os.environ["COLICHAT_HOME"] = str(root / "home")  # sessions and weight caches of the in-process runs
    from colichat.models.default import default_model_path

    t_start = time.perf_counter()
    results = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "code": code_version(),
               "args": vars(args), "lengths": lengths, "models": [], "gen_tokens": GEN_TOKENS}
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
