"""Long-context decode against the roofline, with a per-op profile of where the time goes.

    make bench ARGS="--long-decode"                   # SmolLM2 and the V2-Lite-shaped MLA model
    make bench ARGS="--long-decode --skip-deepseek"   # SmolLM2 only
    python benchmarks/long_decode.py [--skip-smollm2] [--skip-deepseek] [--ctx 4096] [--rounds N] [--before REV]

For each model: the cache is filled with N random rows (what one decode step costs does not depend on the
values of the rows it reads, and a real 4096-token prefill of the MLA model takes minutes), then decode
steps at context 64 and at context N alternate, each step on the same N rows (the cache length is set back
after each), so both see the same machine load; the best step of each counts. The decode roofline
(BENCHMARKS.md, "Formulas") uses the better of the matvec rates measured right before and right after.
With --before REV, a third case alternates with them: decode at context N with the attention functions
of colichat/engine/attention.py as it was at git revision REV (a before/after ratio from one run).
Then a profiled pass per case: every engine function a decode step calls (linear, rms_norm, rope, attention, ...)
is wrapped in a timer, and each op's exclusive time is reported as a share of the step. Last, the engine's
attention with its rows already in the CPU cache (one layer's rows again and again, one thread): attention's
cost without any memory traffic, and from it the most a step at context N could reach even with the weights
streamed at the roofline and that attention shared perfectly by every core.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import common  # noqa: E402  (benchmarks/common.py)
import machine  # noqa: E402  (benchmarks/machine.py: limits and rooflines)

SHORT_CTX = 64


class OpProfile:
    """Wraps the engine functions a decode step calls in timers (exclusive time per label) while active."""

    def __init__(self, extra_attention=()):
        from colichat.engine import attention, ffn
        from colichat.engine.architectures import deepseek2, llama

        self.acc: dict[str, float] = collections.defaultdict(float)
        self._stack: list[float] = []
        self._saved: list[tuple[object, str, object]] = []
        self.targets = [
            (llama, "linear", "attention projections + logits (linear)"),
            (deepseek2, "linear", "attention projections + logits (linear)"),
            (ffn, "linear", "FFN matrices (linear)"),
            (ffn, "silu_mul", "silu_mul"),
            (llama, "rms_norm", "rms_norm"),
            (deepseek2, "rms_norm", "rms_norm"),
            (llama, "rope_norm", "rope"),
            (deepseek2.Forward, "rope", "rope"),
            (llama, "gqa_attention", "attention over the cache"),
            (deepseek2, "mla_absorbed", "attention over the cache"),
            (deepseek2, "mla_naive", "attention over the cache"),
        ]
        for mod in (attention, *extra_attention):
            self.targets += [(mod, "softmax", "softmax (within attention)"),
                             (mod, "_exp_rows", "softmax (within attention)")]

    def _wrap(self, f, label: str):
        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                return f(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                inner = self._stack.pop()
                self.acc[label] += dt - inner
                if self._stack:
                    self._stack[-1] += dt
        return timed_call

    def __enter__(self) -> OpProfile:
        for owner, name, label in self.targets:
            if name not in vars(owner):
                continue
            raw = vars(owner)[name]
            f = raw.__func__ if isinstance(raw, staticmethod) else raw
            self._saved.append((owner, name, raw))
            wrapped = self._wrap(f, label)
            setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, raw in reversed(self._saved):
            setattr(owner, name, raw)
        self._saved.clear()


def attention_of(rev: str):
    """colichat/engine/attention.py as it was at git revision rev, imported beside the current one."""
    import importlib.util
    import subprocess
    import tempfile

    src = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{rev}:colichat/engine/attention.py"],
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="colichat-attention-")) / "attention_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("colichat.engine.attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # its relative imports resolve in colichat.engine
    return mod


def use_attention(mod) -> None:
    """Make the llama and deepseek2 forward passes call mod's attention functions."""
    from colichat.engine.architectures import deepseek2, llama

    llama.gqa_attention = mod.gqa_attention
    deepseek2.mla_absorbed, deepseek2.mla_naive = mod.mla_absorbed, mod.mla_naive


def fill_cache(model, n: int, seed: int = 3) -> None:
    """n random cache rows (token ids and K/V or latent rows), written in blocks; length set to n."""
    cache = model.cache
    rng = np.random.default_rng(seed)
    cache.tokens[:n] = rng.integers(0, model.cfg.n_vocab, n)
    kv = cache.records["kv"]
    for i in range(0, n, 256):
        kv[i : i + 256] = rng.standard_normal(kv[i : i + 256].shape, dtype=np.float32)
    cache.set_length(n)


def profile(model, ctx: int, steps: int, extra_attention=()) -> dict:
    """Per-op exclusive seconds of one decode step at context ctx: the median over `steps` steps (after a
    warm-up) of each op and of the whole step."""
    token = int(model.cache.tokens[0])
    model.cache.set_length(ctx)
    model.decode(token)
    per_step, totals = [], []
    with OpProfile(extra_attention) as prof:
        for _ in range(steps):
            prof.acc.clear()
            model.cache.set_length(ctx)
            totals.append(bench_timed(model.decode, token))
            per_step.append(dict(prof.acc))
    labels = list(dict.fromkeys(k for step in per_step for k in step))
    ops = {k: float(np.median([step.get(k, 0.0) for step in per_step])) for k in labels}
    total = float(np.median(totals))
    ops["other (Python glue, cache row writes, residual adds)"] = max(0.0, total - sum(ops.values()))
    return {"ctx": ctx, "s_per_token": total, "ops_s": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def bench_timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def one_thread_limits() -> dict:
    """sgemm GFLOP/s and matvec GB/s with one BLAS thread, as decode runs (the roofline uses all threads)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1, "blas"):
        return {"sgemm_gflops": machine.measure_sgemm(reps=4), "matvec_gbps": machine.measure_matvec(reps=6)}


def attention_work(model, ctx: int) -> dict:
    """What attention over ctx cached tokens must do per decode step: bytes of cache rows read, and the
    multiply-adds x 2 that are needed (GQA: scores and weighted sum, d_qk + d_v per head and key; MLA
    absorbed: [c | k_pe] scores and the latent sum, (C + R) + C per head and key)."""
    cfg = model.cfg
    if model.cache.kind == "mla":
        per_key_head = 2 * cfg.kv_lora_rank + cfg.rope_dim
    else:
        per_key_head = 2 * cfg.head_dim
    return {"bytes": ctx * model.cache.kv_bytes_per_token,
            "flops": 2.0 * ctx * cfg.n_layer * cfg.n_head * per_key_head}


def attention_in_cache(model, ctx: int, reps: int = 15) -> float:
    """Seconds per step of the engine's attention over ctx cached rows with those rows already in the CPU
    cache: one layer's rows (the cache's own strided view) attended to by one random query again and again
    on one BLAS thread, as decode runs it; the best call times the layers. Attention with no memory
    traffic at all: its floor in this engine on one core."""
    from threadpoolctl import threadpool_limits

    from colichat.engine import attention

    cfg, fwd, cache = model.cfg, model.fwd, model.cache
    rng = np.random.default_rng(5)
    if cache.kind == "mla":
        k_b, v_b = fwd.w["blk.0.attn_k_b"], fwd.w["blk.0.attn_v_b"]  # (H, C, Dn), (H, Dv, C)
        q_nope = rng.standard_normal((1, cfg.n_head, k_b.shape[2]), dtype=np.float32)  # (1, H, Dn)
        q_pe = rng.standard_normal((1, cfg.n_head, cfg.rope_dim), dtype=np.float32)  # (1, H, R)
        kv = cache.records["kv"][:ctx, 0]  # (N, C+R)

        def call():
            attention.mla_absorbed(q_nope, q_pe, kv, k_b, v_b, ctx - 1, fwd.kq_scale)
    else:
        g, e = cfg.n_head_kv, cfg.head_dim
        q = rng.standard_normal((1, cfg.n_head, e), dtype=np.float32)  # (1, H, E)
        k, v = cache.a[0][:ctx].reshape(ctx, g, e), cache.b[0][:ctx].reshape(ctx, g, e)  # (N, G, E)

        def call():
            attention.gqa_attention(q, k, v, ctx - 1, fwd.kq_scale)
    with threadpool_limits(1, "blas"):
        call()
        best = min(bench_timed(call) for _ in range(reps))
    return best * cfg.n_layer


def bench_model(label: str, path: Path, ctx: int, rounds: int, profile_steps: int, before=None) -> dict:
    """Decode at SHORT_CTX and ctx, alternating (and at ctx with `before`'s attention functions when given,
    as a third alternating case), the limits around them, then the per-op profiles."""

    from colichat.engine import attention, load
    from colichat.engine.threads import cores

    common.say(f"{label}: loading {path.name}")
    model = load(str(path), n_ctx=ctx + 16)
    terms = machine.roofline_terms(model)
    fill_cache(model, ctx)
    token = int(model.cache.tokens[1])
    cases = [(f"ctx {SHORT_CTX}", SHORT_CTX, attention), (f"ctx {ctx}", ctx, attention)]
    if before is not None:
        cases.append((f"ctx {ctx}, attention of {before[0]}", ctx, before[1]))
    lim_before = machine.machine_limits(quick=True)
    one_before = one_thread_limits()
    common.say(f"{label}: decode, {len(cases)} cases alternating, {rounds} rounds")
    times: dict[str, list[float]] = {case: [] for case, _, _ in cases}
    try:
        with common.OtherLoad() as other:
            for i in range(rounds + 1):  # round 0 warms up
                for case, n, mod in cases if i % 2 else cases[::-1]:
                    use_attention(mod)
                    model.cache.set_length(n)
                    dt = common.timed(model.decode, token)[0]
                    if i:
                        times[case].append(dt)
        lim_after = machine.machine_limits(quick=True)
        one_after = one_thread_limits()
        common.say(f"{label}: per-op profile")
        extra = (before[1],) if before is not None else ()
        prof = {}
        for case, n, mod in cases:
            use_attention(mod)
            prof[case] = profile(model, n, profile_steps, extra)
    finally:
        use_attention(attention)
    gbps = max(lim_before["matvec_gbps"], lim_after["matvec_gbps"])
    gbps_one = max(one_before["matvec_gbps"], one_after["matvec_gbps"])
    rows = []
    for case, n, _ in cases:
        ts = times[case]
        roof = machine.decode_bytes(terms, n) / (gbps * 1e9)
        roof_one = machine.decode_bytes(terms, n) / (gbps_one * 1e9)
        rows.append({"case": case, "ctx": n, "s_per_token": min(ts), "median_s": float(np.median(ts)),
                     "tok_s": 1 / min(ts), "roofline_tok_s": 1 / roof, "fraction": roof / min(ts),
                     "fraction_of_one_thread_roofline": roof_one / min(ts)})
    work = attention_work(model, ctx)
    work["in_cache_s"] = attention_in_cache(model, ctx)
    del model
    return {"label": label, "path": str(path), "roofline_terms": terms, "limits_before": lim_before,
            "limits_after": lim_after, "matvec_gbps": gbps, "others_cpu": other.share, "decode": rows,
            "profile": prof, "attention_work": work,
            "one_thread": {k: max(one_before[k], one_after[k]) for k in one_before}, "cores": cores()}


def run(models: list[tuple[str, Path]], ctx: int = 4096, rounds: int | None = None, profile_steps: int = 9,
        before: str | None = None) -> dict:
    """before: a git revision whose attention.py is measured beside the current one."""
    mod = (before, attention_of(before)) if before else None
    out = []
    for label, path in models:
        r = rounds or (24 if "SmolLM2" in label else 6)
        out.append(bench_model(label, path, ctx, r, profile_steps, mod))
    return {"ctx": ctx, "before": before, "models": out}


def report(res: dict, markdown: bool = True) -> str:

    parts = []
    rows = [[m["label"], d["case"], f"{d['tok_s']:.1f}", f"{d['s_per_token'] * 1e3:.1f}",
             f"{d['roofline_tok_s']:.1f}", f"{d['fraction']:.0%}", f"{m['matvec_gbps']:.1f}",
             f"{d['fraction_of_one_thread_roofline']:.0%}", f"{m['one_thread']['matvec_gbps']:.1f}",
             f"{m['others_cpu']:.0%}"]
            for m in res["models"] for d in m["decode"]]
    parts.append(common.table(["model", "decode", "tok/s (best)", "ms/token", "roofline tok/s", "fraction",
                              "matvec GB/s", "fraction (1-thread roofline)", "1-thread matvec GB/s", "others' CPU"],
                             rows, markdown))
    for m in res["models"]:
        prof = m["profile"]
        labels = list(dict.fromkeys(k for p in prof.values() for k in p["ops_s"]))
        rows = [[k] + [x for p in prof.values()
                       for x in (f"{p['ops_s'].get(k, 0) * 1e3:.2f}", f"{p['ops_s'].get(k, 0) / p['s_per_token']:.0%}")]
                for k in labels]
        rows.append(["total (profiled step)"] + [x for p in prof.values()
                                                 for x in (f"{p['s_per_token'] * 1e3:.2f}", "100%")])
        parts.append(f"{m['label']}: per-op time of one decode step (medians over the profiled steps)\n")
        parts.append(common.table(["op"] + [x for case in prof for x in (f"ms, {case}", "share")], rows, markdown))
        long_ = prof[f"ctx {res['ctx']}"]
        att = long_["ops_s"].get("attention over the cache", 0) + long_["ops_s"].get("softmax (within attention)", 0)
        w, one = m["attention_work"], m["one_thread"]
        floor = max(w["bytes"] / one["matvec_gbps"], w["flops"] / one["sgemm_gflops"]) / 1e9  # seconds
        d64, dlong = (next(d for d in m["decode"] if d["case"] == f"ctx {n}") for n in (SHORT_CTX, res["ctx"]))
        bound = (1 / dlong["roofline_tok_s"]) / (d64["s_per_token"] + floor)
        parts.append(f"{m['label']}: attention over {res['ctx']} cached tokens takes {att * 1e3:.1f} ms per step: "
                     f"{w['bytes'] / att / 1e9:.1f} GB/s of cache rows ({w['bytes'] / 1e6:.0f} MB) and "
                     f"{w['flops'] / att / 1e9:.1f} GFLOP/s of needed work ({w['flops'] / 1e9:.2f} GFLOP), against "
                     f"{one['matvec_gbps']:.1f} GB/s matvec and {one['sgemm_gflops']:.1f} GFLOP/s sgemm with one BLAS "
                     f"thread in this run: at those rates it would take at least {floor * 1e3:.1f} ms. The step at "
                     f"ctx {SHORT_CTX} ({d64['s_per_token'] * 1e3:.1f} ms) plus that floor would be "
                     f"{(d64['s_per_token'] + floor) * 1e3:.1f} ms at ctx {res['ctx']}: "
                     f"{bound:.0%} of the roofline (measured: {dlong['fraction']:.0%}).")
        hot = w["in_cache_s"]
        roof = 1 / dlong["roofline_tok_s"]
        parts.append(f"{m['label']}: the same attention with its rows already in the CPU cache (one layer's rows "
                     f"again and again, one thread) takes {hot * 1e3:.1f} ms per step ({w['flops'] / hot / 1e9:.1f} "
                     f"GFLOP/s); the step at ctx {SHORT_CTX} plus that would be "
                     f"{(d64['s_per_token'] + hot) * 1e3:.1f} ms: {roof / (d64['s_per_token'] + hot):.0%} of the "
                     f"roofline. 75% would leave attention {(roof / 0.75 - d64['s_per_token']) * 1e3:.1f} ms.")
        roof64, n = 1 / d64["roofline_tok_s"], m["cores"]
        parts.append(f"{m['label']}: even with the weights' part of a step at the roofline ({roof64 * 1e3:.1f} ms, "
                     f"the ctx-{SHORT_CTX} roofline) and that in-cache attention shared perfectly by all {n} cores "
                     f"({hot / n * 1e3:.1f} ms), a step at ctx {res['ctx']} would take "
                     f"{(roof64 + hot / n) * 1e3:.1f} ms: at most {roof / (roof64 + hot / n):.0%} of the roofline.")
        if res.get("before"):
            b = next(d for d in m["decode"] if d["case"] != dlong["case"] and d["ctx"] == res["ctx"])
            parts.append(f"{m['label']}: decode at ctx {res['ctx']}, this code / attention of {res['before']}: "
                         f"{dlong['s_per_token'] / b['s_per_token']:.3f} (best steps), "
                         f"{dlong['median_s'] / b['median_s']:.3f} (medians).")
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    import json

    from colichat.models.default import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-deepseek", action="store_true")
    p.add_argument("--ff", type=int, default=2816, help="dense FFN width of the deepseek2 model (default 2816)")
    p.add_argument("--ctx", type=int, default=4096, help="the long context (default 4096)")
    p.add_argument("--rounds", type=int, default=None, help="decode steps per case (default 24 SmolLM2, 6 MLA)")
    p.add_argument("--before", metavar="REV", default=None,
                   help="also decode at the long context with attention.py of git revision REV, alternating")
    args = p.parse_args(argv)
    common.OUT.mkdir(parents=True, exist_ok=True)
    models = [] if args.skip_smollm2 else [("SmolLM2-135M", Path(default_model_path()))]
    if not args.skip_deepseek:
        models.append((f"V2-Lite-shaped (FFN {args.ff})", common.deepseek_gguf(args.ff)))
    t0 = time.perf_counter()
    res = run(models, args.ctx, args.rounds, before=args.before)
    res.update(machine=machine.machine_info(), date=time.strftime("%Y-%m-%d %H:%M:%S %z"), code=machine.code_version(),
               run_s=time.perf_counter() - t0)
    (common.OUT / "long_decode.json").write_text(json.dumps(res, indent=1))
    (common.OUT / "long_decode.md").write_text(report(res, markdown=True))
    print(report(res, markdown=False))
    print(f"run time {res['run_s']:.0f} s; wrote {common.OUT / 'long_decode.json'}, long_decode.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
