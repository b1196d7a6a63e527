"""Dense models side by side with llama.cpp (issue 45's targets): a Llama-3.1-8B-shaped GGUF of random blocks,
and SmolLM2-135M, the default model.

    .venv/bin/python benchmarks/dense.py --shape llama8b --vs-llamacpp "$(../shared/tools/llamacpp/make-venv.sh)"
    .venv/bin/python benchmarks/dense.py --shape smollm2 --vs-llamacpp PYTHON
    .venv/bin/python benchmarks/dense.py --shape llama8b --layers 2 --vs-llamacpp PYTHON    # a smoke run
    make bench ARGS="--dense --shape llama8b --vs-llamacpp PYTHON"                        # the same via make

llama8b: tests/gguf_factory.LLAMA_8B, written once as a stream to --dir (default ~/.cache/colichat-bench/,
llama8b.gguf, 5.1 GB; llama8b-L2.gguf with --layers 2): 32 layers, hidden 4096, 32 heads and 8 KV heads of
128, FFN 14336, vocabulary 128256, rope base 500000 with llama-3.1's rope_freqs; every matrix Q4_K but
ffn_down and output Q6_K (a Q4_K_M-like mix), norms f32; a llama-3-style BPE vocabulary (llama-bpe).
Figures: load, prefill 512, decode tokens 1-24 and 25-48 after it (the steady state), peak RSS.
smollm2: the default model's file (colichat/models/default.py). Figures: load, prefill 512 and decode after it,
prefill 2048 and decode after it ("decode at 512 / 2048": tokens 25-48), then restore 2048 + 1: the state
after the 2048 tokens saved to disk, reopened into an emptied cache and one token decoded (colichat: a
session, opened as --resume does into a new cache; llama.cpp: llama_state_save_file / load_file), beside
re-prefill 2048 + 1; the best of --reps (3) runs of each.

Each engine runs in its own process (its peak RSS is its own) on the same token ids, colichat with its
defaults (no prepared-weights cache: the load is a first start's), llama.cpp with n_threads=2 and
n_threads_batch=2 (llama-cpp-python 0.3.36, imported only in the child this script starts with that python).
A refusal (colichat: "its weights need 29.9 GiB as f32") is the result. Each figure is also given as a
fraction of the machine's measured limit (benchmarks/common.py): decode against the read bandwidth over the
quantized bytes a token reads, and in Gparam/s against llama.cpp's and numpy's f32 matvec; prefill against
sgemm. Markdown on stdout, then a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # gguf_factory writes the llama8b file
import common  # noqa: E402  (benchmarks/common.py)
import machine  # noqa: E402  (benchmarks/machine.py: the limits, what a token costs)

SHAPES = {  # contexts measured; whether restore is; runs of each (the best kept)
    "llama8b": {"contexts": (512,), "restore": False, "reps": 1},
    "smollm2": {"contexts": (512, 2048), "restore": True, "reps": 3},
}
FIRST, DECODE = 24, 48  # decode: tokens 1..FIRST, then FIRST+1..DECODE (the steady state)
SEED = 45


def model_file(shape: str, folder: Path, layers: int | None) -> Path:
    """The GGUF of a shape: SmolLM2's own file, or the llama8b file (written once; `layers` overrides 32)."""
    if shape == "smollm2":
        from colichat.models.default import default_model_path

        return Path(default_model_path())
    from gguf_factory import LLAMA_8B, llama_tensors, write_llama

    n = layers or LLAMA_8B.n_layer
    path = folder / f"llama8b{'' if n == LLAMA_8B.n_layer else f'-L{n}'}.gguf"
    return common.write_once(path, lambda p: write_llama(p, LLAMA_8B, n_layer=n),
                             len(llama_tensors(LLAMA_8B)) - 9 * (LLAMA_8B.n_layer - n))


def token_ids(n_vocab: int, contexts) -> dict[str, list[int]]:
    """The prompts and decode tokens both engines get (fixed seed, above the byte and special tokens)."""
    rng = np.random.default_rng(SEED)
    out = {f"prompt{c}": rng.integers(300, n_vocab, c).tolist() for c in contexts}
    out["decode"] = rng.integers(300, n_vocab, DECODE).tolist()
    return out


# --- one engine, in its own process --------------------------------------------------------------------


def child(engine_name: str, path: str, tok_file: str, shape: str, load_args: dict) -> dict:
    """One engine's figures on one file: phases at each context (the best of reps), then restore."""
    tokens, cfg = json.loads(Path(tok_file).read_text()), SHAPES[shape]
    work = str(Path(tok_file).parent)
    n_ctx = max(cfg["contexts"]) + DECODE + 16
    t = time.perf_counter()
    try:
        if engine_name == "colichat":
            engine = common.colichat(path, n_ctx, work, **load_args)
        else:
            engine = common.llamacpp(path, n_ctx, work)
    except Exception as e:  # a refusal (colichat's memory check) or a failure to load is the result
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"load_s": time.perf_counter() - t, "rss_load": common.peak_rss()}
    if engine_name == "colichat":
        out.update(memory=str(engine.model().memory_estimate()), kernels_s=engine.kernels_s)
    dec, stem = tokens["decode"], f"{Path(path).stem}-{engine_name}"
    for c in cfg["contexts"]:
        ids = tokens[f"prompt{c}"]
        steps = [(f"prefill{c}", lambda ids=ids: engine.prefill(ids), True),
                 (f"decode{c}_first", lambda: [engine.decode(i) for i in dec[:FIRST]][-1], False),
                 (f"decode{c}_steady", lambda: [engine.decode(i) for i in dec[FIRST:]][-1], False)]
        for _ in range(cfg["reps"]):
            run = {}
            common.run_phases(run, engine, steps, Path(work), stem)
            for phase, fig in run.items():  # the best run of each phase
                if phase == "peak_rss" or phase not in out or fig["s"] < out[phase]["s"]:
                    out[phase] = fig
    if cfg["restore"]:
        out["restore"] = restore(engine, tokens[f"prompt{c}"], dec[0], cfg["reps"])
    out["peak_rss"] = common.peak_rss()
    return out


def restore(engine, ids: list[int], next_id: int, reps: int) -> dict:
    """Re-prefill n + 1 (prefill the n tokens into an empty cache, decode one) against restore n + 1 (the state
    after n tokens saved to disk, read back into an emptied cache, one token decoded): the best of reps each;
    whether the restored logits are the never-stopped ones bit for bit."""
    reprefill, restores, same, saved = [], [], True, None
    for _ in range(reps):
        engine.fresh()
        t_prefill, _ = common.timed(engine.prefill, ids)
        saved = saved or common.timed(engine.save)  # the state after the n tokens (the first time)
        t_decode, ref = common.timed(engine.decode, next_id)
        reprefill.append(t_prefill + t_decode)
    for _ in range(reps):
        t_load, n = common.timed(engine.restore)
        t_decode, logits = common.timed(engine.decode, next_id)
        restores.append((t_load + t_decode, t_load))
        same = same and n == len(ids) and bool(np.array_equal(logits, ref))
    best = min(restores)
    return {"tokens": len(ids), "reprefill_s": min(reprefill), "restore_s": best[0], "restore_load_s": best[1],
            "save_s": saved[0], "state_bytes": saved[1], "identical": same}


# --- report -------------------------------------------------------------------------------------------


def figures(shape: str) -> list[tuple[str, str, str]]:
    """(key, label, kind) of the table's rows for a shape."""
    rows = [("load_s", "load, s", "time")]
    for c in SHAPES[shape]["contexts"]:
        rows += [(f"prefill{c}", f"prefill {c} tokens, tok/s", "rate"),
                 (f"decode{c}_first", f"decode at {c}: tokens 1-{FIRST}, tok/s", "rate"),
                 (f"decode{c}_steady", f"decode at {c}: tokens {FIRST + 1}-{DECODE} (steady), tok/s", "rate")]
    if SHAPES[shape]["restore"]:
        c = max(SHAPES[shape]["contexts"])
        rows += [("restore_ms", f"restore {c} + 1 from disk (colichat: resume; llama.cpp: state file), ms", "time"),
                 ("reprefill_ms", f"re-prefill {c} + 1, ms", "time"),
                 ("state_mib", f"saved state of {c} tokens, MiB", "size")]
    return rows + [("peak_rss_gib", "peak RSS, GiB (file pages included)", "size")]


def rates(run: dict | None, shape: str) -> dict:
    """One engine's figures: load s, tok/s, restore ms, peak RSS GiB ({} where it did not run)."""
    if not run or "error" in run:
        return {}
    out = {"load_s": run["load_s"], "peak_rss_gib": run["peak_rss"] / common.GIB}
    for c in SHAPES[shape]["contexts"]:
        out[f"prefill{c}"] = c / run[f"prefill{c}"]["s"]
        out[f"decode{c}_first"] = FIRST / run[f"decode{c}_first"]["s"]
        out[f"decode{c}_steady"] = (DECODE - FIRST) / run[f"decode{c}_steady"]["s"]
    if "restore" in run:
        r = run["restore"]
        out.update(restore_ms=r["restore_s"] * 1e3, reprefill_ms=r["reprefill_s"] * 1e3,
                   state_mib=r["state_bytes"] / (1 << 20))
    return out


# --- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=SHAPES, default="llama8b", help="llama8b (default) or smollm2")
    p.add_argument("--vs-llamacpp", metavar="PYTHON", help="a python with llama-cpp-python 0.3.36: run it too")
    p.add_argument("--layers", type=int, help="llama8b's layers (default 32; 2 for a smoke run)")
    p.add_argument("--reps", type=int, help="runs of each phase, the best kept (default: 1 llama8b, 3 smollm2)")
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "colichat-bench", help="where files go")
    p.add_argument("--load-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to colichat's engine.load (e.g. kernels=numpy), repeatable")
    p.add_argument("--dense", action="store_true", help=argparse.SUPPRESS)  # make bench ARGS=--dense passes it on
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "GGUF", "TOKENS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reps:
        SHAPES[args.shape]["reps"] = args.reps
    load_args = dict(a.split("=", 1) for a in args.load_arg)
    if args.child:  # one engine on one file: its figures as JSON on the last line
        print(json.dumps(child(*args.child, args.shape, load_args)))
        return 0
    t0, load0 = time.perf_counter(), os.getloadavg()
    path = model_file(args.shape, args.dir, args.layers)
    common.say(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; measuring the machine")
    lim = machine.measure_machine()
    cost = machine.token_cost(path)
    tmp = tempfile.TemporaryDirectory(prefix="colichat-dense-")
    work = Path(tmp.name)
    tok_file = work / "tokens.json"
    tok_file.write_text(json.dumps(token_ids(vocab_size(path), SHAPES[args.shape]["contexts"])))
    flags = ["--shape", args.shape] + [f"--reps={args.reps}"] * bool(args.reps)
    flags += [f"--load-arg={a}" for a in args.load_arg]
    common.say("colichat")
    col = common.run_child([sys.executable, __file__, "--child", "colichat", str(path), str(tok_file), *flags])
    ref = None
    if args.vs_llamacpp:
        common.say("llama.cpp")
        ref = common.run_child([args.vs_llamacpp, __file__, "--child", "llamacpp", str(path), str(tok_file), *flags])
    common.say("measuring the machine again")
    lim = machine.faster(lim, machine.measure_machine())
    lim["kernels"] = machine.measure_kernels()
    c, r = rates(col, args.shape), rates(ref, args.shape)
    load1 = os.getloadavg()
    print(f"## {args.shape}: {path.name}, {path.stat().st_size / 1e9:.2f} GB\n\n{time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores; load average (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}\n")
    print(machine.machine_table(lim))
    for name, run in (("colichat", col), ("llama.cpp", ref)):
        if run and "error" in run:
            print(f"{name} did not run: {run['error']}\n")
    print(common.side_by_side(figures(args.shape), c, r if ref is not None else None))
    runs = [x for x in (col, ref) if x and "error" not in x]
    phases = [k for k, _, _ in figures(args.shape) if any(isinstance(x.get(k), dict) for x in runs)]
    if runs:
        print("CPU share other processes used per phase (" + ", ".join(phases) + "): "
              + "; ".join(" / ".join(f"{x[p]['others_cpu']:.2f}" for p in phases) for x in runs) + "\n")
    for name, x in (("colichat", col), ("llama.cpp", ref)):
        if x and "restore" in x:
            print(f"{name}: restored logits identical to never stopped: {x['restore']['identical']}")
    if c:
        print(f"\ncolichat: {col['memory']}" + common.kernels_note(col) + "\n")
    ctxs = SHAPES[args.shape]["contexts"]
    print(machine.limits_table(cost, lim, c, r, [(f"decode{n}_steady", f"decode at {n} (steady)", n) for n in ctxs],
                              [(f"prefill{n}", f"prefill {n}") for n in ctxs]))
    if c and r:
        print("correlation of colichat's last logits with llama.cpp's, per phase: "
              + common.correlations(work, path.stem, phases) + "\n")
    tmp.cleanup()
    print(json.dumps({"shape": args.shape, "file": str(path), "limits": lim, "cost": cost, "colichat": c,
                      "llamacpp": r, "colichat_run": col, "llamacpp_run": ref, "loadavg": [load0, load1],
                      "run_s": time.perf_counter() - t0}, separators=(",", ":")))
    return 0


def vocab_size(path: Path) -> int:
    """The vocabulary's size: {arch}.vocab_size, else the length of tokenizer.ggml.tokens."""
    from colichat.engine.gguf.header import read_header

    with open(path, "rb") as f:
        head = read_header(f.read(64 << 20), keep=lambda k: k.endswith("vocab_size") or k == "tokenizer.ggml.tokens")
    return next((v for k, v in head.kv.items() if k.endswith(".vocab_size")), None) or len(
        head.kv["tokenizer.ggml.tokens"])


if __name__ == "__main__":
    sys.exit(main())
