"""bench.py's results as tables (plain text on stdout, markdown in bench.md and BENCHMARKS.md) and a plot:
decode and prefill as fractions of the rooflines, the targets met or not, the machine they ran on."""

from __future__ import annotations

from pathlib import Path

from common import table
from machine import decode_bytes, prefill_flops


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
    gen = results["gen_tokens"]
    parts.append(title(f"Append one turn of {gen} records vs generating it"))
    rows = [[m["label"], r["tokens"], f"{r['append_s'] * 1e3:.1f}", f"{r['append_median_s'] * 1e3:.1f}",
             f"{r['decode_s_per_token'] * 1e3:.1f}", f"{r['generate_turn_s']:.2f}",
             f"{r['append_s'] / r['generate_turn_s']:.2%}"] for m in results["models"] for r in m["lengths"]]
    parts.append(table(["model", "history", "append ms", "append median ms", "decode ms/token",
                        f"generate {gen} s", "append share"], rows, markdown))
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
