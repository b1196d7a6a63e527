"""A MoE model at the real size (issue 34): colichat on a DeepSeek-V2-Lite-shaped GGUF against the machine's
numpy limit and, side by side, llama.cpp on the same file.

    .venv/bin/python benchmarks/moe.py [--vs-llamacpp "$(../shared/tools/llamacpp/make-venv.sh)"]
    .venv/bin/python benchmarks/moe.py --layers 3 --uniform-only     # a smoke run on a 3-layer file
    make bench ARGS="--moe --vs-llamacpp PYTHON"                     # the same through the Makefile
    .venv/bin/python benchmarks/moe.py --shape glm47flash --uniform-only  # GLM-4.7-Flash's shape (GLM47_FLASH)

Files (random blocks, written once as a stream to --dir, default ~/.cache/colichat-bench/; 11.9 GB at 27
layers): V2-Lite's shape (hidden 2048, 16 heads, no q_lora, kv_lora 512, one dense layer of 10944, then 64
routed experts of 1408 + 2 shared, 6 used, softmax gating, vocabulary 102400, YaRN 40), experts gate/up
Q4_K and down Q8_0, other matrices Q8_0, norms and routers f32. v2lite-uniform.gguf routes near uniformly
(an expert cache's worst case); v2lite-skewed.gguf has a selection bias (exp_probs_b: it only chooses) on
13 of each layer's 64 experts, so that they get about 60% of the routes (measured and printed).

Each engine runs in its own process (its peak RSS is its own) on the same token ids: load; prefill 64;
a fresh KV cache and prefill 512; decode 48 tokens after those (1-24, then 25-48, the steady state).
colichat: its default threads and expert cache (--expert-cache overrides); the 512 tokens get a new Model
over the same weights (a cold expert cache). llama.cpp (llama-cpp-python, imported only in the child this
script starts with that python): n_threads=2, n_threads_batch=2. Each phase records the share of the CPUs
other processes used meanwhile (a shared machine: figures with a high share are disturbed). Each figure is
also a fraction of the machine's limit (machine.py: decode against the read bandwidth over the quantized bytes
a token reads, in Gparam/s against llama.cpp's; prefill against sgemm), and of the numpy path's own bound.
Ratios: speeds colichat's over llama.cpp's (a time's: llama.cpp's over colichat's), memory colichat's over
llama.cpp's. On an engine that multiplies the experts in the map there is no expert cache to report.
Markdown tables on stdout, then a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # gguf_factory writes the model
import common  # noqa: E402  (benchmarks/common.py: probes, files, the engines' children, tables)
import machine  # noqa: E402  (benchmarks/machine.py: the limits, what a token costs)
from common import GIB, say  # noqa: E402

MOE = dict(  # V2-Lite's MoE part, over gguf_factory.V2_LITE_DENSE's attention, vocabulary and YaRN
    n_dense=1, n_ff=10944, n_expert=64, n_expert_used=6, n_expert_shared=2, n_ff_exp=1408, gating=1,
    n_group=0, weights_norm=False, weights_scale=1.0,
    qtypes={"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q8_0"},
)
# GLM-4.7-Flash's shape (zai-org/GLM-4.7-Flash config.json: deepseek2 in llama.cpp, 30B-A3B): 47 layers, hidden
# 2048, 20 heads, q_lora 768, kv_lora 512, qk_nope 192, qk_rope 64, v_head 256, one dense layer of 10240, then
# 64 routed experts of 1536 + 1 shared, 4 used, sigmoid gating, weights normalized and scaled 1.8, vocabulary
# 154880, rope base 1e6 (its MTP block is left out: llama.cpp 0.3.36 does not use it)
GLM47_FLASH = dict(
    n_layer=47, n_embd=2048, n_head=20, q_lora_rank=768, kv_lora_rank=512, qk_nope=192, qk_rope=64, v_head=256,
    n_ff=10240, n_dense=1, n_expert=64, n_expert_used=4, n_expert_shared=1, n_ff_exp=1536, gating=2, n_group=0,
    weights_norm=True, weights_scale=1.8, n_vocab=154880, context_length=202752, yarn_factor=0.0, rope_base=1e6,
    qtype="Q8_0", raw_quant=True, qtypes=MOE["qtypes"],
)
SHAPES = {"v2lite": 27, "glm47flash": 47}  # shape -> its layers
HOT = 13  # experts per layer with the selection bias in the skewed file: 20% of 64
SKEW_BIAS = 0.033  # added to their softmax probabilities (~1/64 each) before the top 6 are chosen
PHASES = ("prefill64", "prefill512", "decode_first", "decode_steady")
FIRST, DECODE = 24, 48  # decode: tokens 1..FIRST, then FIRST+1..DECODE (steady state)
N_CTX = 1024
SEED = 34
QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "Q4_0")
FP16_AT = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


# --- the files ---------------------------------------------------------------------------------------


def spec_for(layers: int, skewed: bool, shape: str = "v2lite"):
    """The DS2Spec of the MoE file of `shape` (V2-Lite's or GLM-4.7-Flash's) with `layers` layers (the skewed
    one has exp_probs_b)."""
    from gguf_factory import V2_LITE_DENSE, DS2Spec

    if shape == "glm47flash":
        return replace(DS2Spec(**GLM47_FLASH), n_layer=layers, probs_bias=skewed)
    return replace(V2_LITE_DENSE, **MOE, n_layer=layers, probs_bias=skewed)


def model_file(folder: Path, layers: int, skewed: bool, bias: float, shape: str = "v2lite") -> Path:
    """The file (written once, as a stream: memory for one expert) and, if skewed, its bias set to `bias`."""
    from gguf_factory import tensor_shapes, write_deepseek2

    spec = spec_for(layers, skewed, shape)
    full = layers == SHAPES[shape]
    path = folder / f"{shape}-{'skewed' if skewed else 'uniform'}{'' if full else f'-L{layers}'}.gguf"
    common.write_once(path, lambda part: write_deepseek2(part, spec), len(tensor_shapes(spec)))
    if skewed:
        set_bias(path, bias)
    return path


def set_bias(path: Path, bias: float) -> None:
    """exp_probs_b of every MoE layer, in place: `bias` for HOT experts picked per layer (fixed seed), else 0."""
    import gguf

    r = gguf.GGUFReader(path, "r+")
    rng = np.random.default_rng(SEED)
    for t in r.tensors:
        if t.name.endswith("exp_probs_b.bias"):
            b = np.zeros(t.data.shape, dtype=np.float32)  # (X,)
            b[rng.choice(b.size, HOT, replace=False)] = bias
            t.data[...] = b
    r.data.flush()


def token_ids(n_vocab: int) -> dict[str, list[int]]:
    """The prompts and decode tokens both engines get (fixed seed, above the byte and special tokens)."""
    rng = np.random.default_rng(SEED)
    return {"prompt64": rng.integers(300, n_vocab, 64).tolist(), "prompt512": rng.integers(300, n_vocab, 512).tolist(),
            "decode": rng.integers(300, n_vocab, DECODE).tolist()}


# --- the engines, each in a child process ---------------------------------------------------------------


def phases(tokens: dict, engine) -> list:
    """The phases, the same for both engines, as common.run_phases runs them: (name, fn, fresh cache first)."""
    dec = tokens["decode"]
    return [("prefill64", lambda: engine.prefill(tokens["prompt64"]), False),
            ("prefill512", lambda: engine.prefill(tokens["prompt512"]), True),
            ("decode_first", lambda: [engine.decode(i) for i in dec[:FIRST]][-1], False),
            ("decode_steady", lambda: [engine.decode(i) for i in dec[FIRST:]][-1], False)]


class RouteCounter:
    """Counts the experts colichat's router picks per layer (wraps deepseek2.Forward.ffn to know the layer,
    ffn.select_experts to see the picks)."""

    def __init__(self, n_layer: int, n_expert: int):
        from colichat.engine import ffn
        from colichat.engine.architectures import deepseek2

        self.counts = np.zeros((n_layer, n_expert), dtype=np.int64)  # (L, X)
        self.layer = None
        fwd_ffn, select = deepseek2.Forward.ffn, ffn.select_experts

        def layer_ffn(fwd, l, u, *rest):
            self.layer = l
            try:
                return fwd_ffn(fwd, l, u, *rest)
            finally:
                self.layer = None

        def counted(probs, bias, r):
            ids, w = select(probs, bias, r)  # (T, U) x2
            if self.layer is not None:  # the layer's own routing (not the next layer's prediction after it)
                np.add.at(self.counts[self.layer], ids.reshape(-1), 1)
                self.layer = None
            return ids, w

        deepseek2.Forward.ffn, ffn.select_experts = layer_ffn, counted

    def take(self, hot: np.ndarray | None) -> dict:
        """Share of the routes since the last take that went to each layer's top 20% of experts and (skewed
        file; hot: (L, X) bool) to the biased ones. Resets the counts."""
        c, self.counts = self.counts, np.zeros_like(self.counts)
        if not c.sum():
            return {}
        out = {"top20_share": float(np.sort(c, axis=1)[:, ::-1][:, :HOT].sum() / c.sum())}
        if hot is not None:
            out["biased_share"] = float((c * hot).sum() / c.sum())
        return out


def colichat(path: str, expert_cache: float | None, load_args: dict) -> SimpleNamespace:
    """colichat as run_phases drives it; fresh() gives a new Model over the same weights (an empty KV cache
    and a cold expert cache of the same size). With experts multiplied where they lie in the map (no slab
    of its own: the page cache is the expert cache), fresh() gives a new KV cache only and note() the routes."""
    from colichat.engine import Model

    m, kernels_s = common.load_colichat(path, N_CTX, expert_cache=expert_cache, **load_args)
    slab = hasattr(m.experts, "capacity")  # an expert cache of its own, with its counters
    prefetch = bool(os.environ.get("COLICHAT_BENCH_PREFETCH")) and slab
    if prefetch:
        m.experts.prefetcher = ThreadPoolExecutor(1, "colichat-prefetch")
    cfg, state = m.cfg, {"m": m, "seen": (0, 0, 0, 0, 0)}
    routes = RouteCounter(cfg.n_layer, cfg.n_expert)
    bias = [m.w.get(f"blk.{l}.exp_probs_b", np.zeros(cfg.n_expert)) for l in range(cfg.n_layer)]
    hot = np.stack(bias) > 0 if any("exp_probs_b" in k for k in m.w) else None  # (L, X)

    def fresh() -> None:
        if not slab:
            common.fresh_cache(state["m"])
            return
        old = state.pop("m")
        w, tok, tensors, mib = old.w, old.tokenizer, old.tensors, old.experts.capacity / (1 << 20)
        del old
        gc.collect()
        state.update(m=Model(cfg, w, tok, N_CTX, tensors, expert_cache=mib), seen=(0, 0, 0, 0, 0))
        if prefetch:
            state["m"].experts.prefetcher = ThreadPoolExecutor(1, "colichat-prefetch")

    def note() -> dict:
        if not slab:
            return routes.take(hot)
        e, was = state["m"].experts, state["seen"]
        now = (e.hits, e.misses, e.prefetched, e.predictions, e.predicted_right)
        state["seen"] = now
        d = dict(zip(("hits", "misses", "prefetched", "predictions", "predicted_right"),
                     (a - b for a, b in zip(now, was, strict=True)), strict=True))
        return {**d, **routes.take(hot)}

    return SimpleNamespace(prefill=lambda ids: state["m"].prefill(ids, all_logits=False), fresh=fresh, note=note,
                           decode=lambda i: state["m"].decode(i), model=lambda: state["m"], kernels_s=kernels_s)


def child(engine_name: str, path: str, tok_file: str, expert_cache: float | None, load_args: dict) -> dict:
    """One engine's figures on one file (in a child process: its peak RSS is its own)."""
    tokens = json.loads(Path(tok_file).read_text())
    t = time.perf_counter()
    try:
        engine = colichat(path, expert_cache, load_args) if engine_name == "colichat" else common.llamacpp(path, N_CTX)
    except Exception as e:  # a refusal or a failure to load is the result
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"load_s": time.perf_counter() - t, "rss_load": common.peak_rss()}
    if engine_name == "colichat":
        m = engine.model()
        out.update(memory=str(m.memory_estimate()), kernels_s=engine.kernels_s)
        if hasattr(m.experts, "capacity"):
            out["expert_cache_mib"] = m.experts.capacity >> 20
        del m
    common.run_phases(out, engine, phases(tokens, engine), Path(tok_file).parent, f"{Path(path).stem}-{engine_name}")
    return out


# --- the numpy limit ----------------------------------------------------------------------------------


def dequantizer(name: str):
    """(fn(blocks, out), label): what colichat dequantizes a quant type with (engine/gguf/dequant.FAST, writing into
    `out` where it can, as into an expert-cache slot), or gguf-py's gguf.quants.dequantize."""
    import gguf

    from colichat.engine.gguf import dequant

    fast = dequant.FAST.get(name)
    if fast is not None and "out" in inspect.signature(fast).parameters:
        return (lambda data, out: fast(data, out=out)), "colichat, into a buffer"
    if fast is not None:
        return (lambda data, out: fast(data)), "colichat"
    qtype = gguf.GGMLQuantizationType[name]
    return (lambda data, out: gguf.quants.dequantize(data, qtype)), "gguf-py"


def measure_limits(mb: int = 30) -> dict:
    """Measured: common.measure_machine (read bandwidth, f32 matvec, sgemm), copy bandwidth, and dequantize
    throughput per quant type on `mb` MB of random blocks (sane fp16 scales) in pieces of one expert matrix
    (1408 x 2048 values), on 1 and on 2 threads."""
    import gguf

    rng = np.random.default_rng(0)
    best = common.best

    def copy() -> float:  # each byte read once and written once; the target touched first (no page faults)
        src, dst = np.ones(256 << 20, dtype=np.uint8), np.zeros(256 << 20, dtype=np.uint8)
        return src.nbytes / best(lambda: np.copyto(dst, src)) / 1e9

    def dequantize(name: str, pool: ThreadPoolExecutor) -> dict:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        per = 1408 * 2048 // block  # blocks of one expert matrix
        data = rng.integers(0, 256, ((mb << 20) // size // per * per, size), dtype=np.uint8)  # (blocks, bytes)
        for at in FP16_AT[name]:
            data[:, at : at + 2] = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
        out = np.zeros(data.shape[0] * block, dtype=np.float32)  # touched, as a slab slot that was filled before
        fn, impl = dequantizer(name)
        pieces = [(data[i : i + per], out[i * block : (i + per) * block]) for i in range(0, data.shape[0], per)]
        one = best(lambda: [fn(*p) for p in pieces], 3)
        two = best(lambda: list(pool.map(lambda p: fn(*p), pieces)), 3)
        return {"impl": impl, "in_mbps": data.nbytes / one / 1e6, "out_mbps": out.nbytes / one / 1e6,
                "in_mbps_2": data.nbytes / two / 1e6}

    with ThreadPoolExecutor(2) as pool:
        deq = {name: dequantize(name, pool) for name in QUANT_TYPES}
    return {**machine.measure_machine(), "copy_gbps": copy(), "dequant": deq}


def bounds(spec, lim: dict) -> dict:
    """The numpy limit. Decode seconds per token: every f32 byte it touches (the dense part: all matrices,
    routers and norms but the routed experts, the output head, one embedding row; and 6 routed experts per
    MoE layer) read once at the matvec bandwidth, plus, per missed expert, dequantizing its Q4_K gate/up and
    Q8_0 down (on 2 threads where faster). Prefill 512: every expert of every MoE layer dequantized once plus
    its FLOPs (2 x tokens x active parameters, attention, the last token's logits) at the sgemm rate."""
    from gguf_factory import tensor_shapes

    d, fe, u, t = spec.n_embd, spec.n_ff_exp, spec.n_expert_used, 512
    dense = layer_params = 0
    for name, shape in tensor_shapes(spec):
        if "_exps." not in name:
            dense += 4 * (d if name == "token_embd.weight" else int(np.prod(shape)))
            layer_params += int(np.prod(shape)) if name.startswith("blk.") and len(shape) >= 2 else 0
    n_moe, expert = spec.n_layer - spec.n_dense, 3 * fe * d  # MoE layers; values of one expert
    q4k, q80 = 2 * fe * d // 256 * 144, d * fe // 32 * 34  # an expert's bytes in the file
    deq = lim["dequant"]
    miss_1 = (q4k / deq["Q4_K"]["in_mbps"] + q80 / deq["Q8_0"]["in_mbps"]) / 1e6
    miss = min(miss_1, (q4k / deq["Q4_K"]["in_mbps_2"] + q80 / deq["Q8_0"]["in_mbps_2"]) / 1e6)  # both cores
    bw = max(lim["matvec_gbps_1"], lim["matvec_gbps_2"]) * 1e9
    routed = 4 * expert * u * n_moe
    hit = (dense + routed) / bw
    attn = spec.n_layer * spec.n_head * (spec.qk_head + spec.v_head) * t * (t + 1)  # 2 x H x (K + Dv) x T(T+1)/2
    flops = 2 * t * (layer_params + expert * u * n_moe) + attn + 2 * spec.n_vocab * d
    return {"dense": dense, "routed": routed, "routes": u * n_moe, "n_moe": n_moe, "expert_f32": 4 * expert,
            "expert_q": q4k + q80, "miss_s_1thread": miss_1, "miss_s": miss, "dense_s": dense / bw,
            "routed_s": routed / bw, "decode_hit_s": hit, "decode_miss_s": hit + u * n_moe * miss,
            "prefill512_deq_s": n_moe * spec.n_expert * miss, "prefill512_flops": flops,
            "prefill512_s": n_moe * spec.n_expert * miss + flops / (lim["sgemm_gflops"] * 1e9)}


# --- report -------------------------------------------------------------------------------------------

FIGURES = [("load_s", "load, s", "time"), ("prefill64", "prefill 64 tokens, tok/s", "rate"),
           ("prefill512", "prefill 512 tokens, tok/s", "rate"),
           ("decode_first", f"decode tokens 1-{FIRST}, tok/s", "rate"),
           ("decode_steady", f"decode tokens {FIRST + 1}-{DECODE} (steady), tok/s", "rate"),
           ("peak_rss_gib", "peak RSS, GiB", "size"), ("finite", "logits finite in every phase", "flag")]


def rates(r: dict | None) -> dict:
    """The figures of one engine's run: load s, tok/s, peak RSS GiB ({} where it did not run)."""
    if not r or "error" in r:
        return {}
    n = {"prefill64": 64, "prefill512": 512, "decode_first": FIRST, "decode_steady": DECODE - FIRST}
    return {"load_s": r["load_s"], **{p: n[p] / r[p]["s"] for p in PHASES}, "peak_rss_gib": r["peak_rss"] / GIB,
            "finite": all(r[p]["finite"] for p in PHASES)}


def report_limits(lim: dict, b: dict) -> None:
    """The measured machine and the bounds worked out from it."""
    print("### The machine's limits, and numpy's (the better of two measurements, before and after)\n\n"
          + machine.machine_table(lim)
          + f"| copy of 256 MiB (each byte read and written) | {lim['copy_gbps']:.1f} GB/s |\n")
    print("| quant type | dequantizer | input MB/s, 1 thread | f32 output MB/s, 1 thread | output / copy bandwidth "
          "| input MB/s, 2 threads |\n|---|---|---|---|---|---|")
    for name, q in lim["dequant"].items():
        print(f"| {name} | {q['impl']} | {q['in_mbps']:,.0f} | {q['out_mbps']:,.0f} | "
              f"{q['out_mbps'] / 1e3 / lim['copy_gbps']:.0%} | {q['in_mbps_2']:,.0f} |")
    rows = [
        ("dense part: attention, dense layer, shared experts, routers, norms, output head, 1 embedding row",
         f"{b['dense'] / GIB:.2f} GiB", f"{b['dense_s']:.3f} s"),
        (f"routed experts: {b['routes']} = {b['routes'] // b['n_moe']} x {b['n_moe']} layers of "
         f"{b['expert_f32'] / 2**20:.0f} MiB",
         f"{b['routed'] / GIB:.2f} GiB", f"{b['routed_s']:.3f} s"),
        (f"one expert miss: dequantize its {b['expert_q'] / 2**20:.1f} MiB of Q4_K gate/up + Q8_0 down, "
         "1 thread / the better of 1 and 2", "", f"{b['miss_s_1thread'] * 1e3:.1f} / {b['miss_s'] * 1e3:.1f} ms"),
        ("**decode at 100% expert-cache hits**", "",
         f"**{b['decode_hit_s']:.2f} s = {1 / b['decode_hit_s']:.2f} tok/s**"),
        (f"**decode at 0% hits** (+ {b['routes']} misses)", "",
         f"**{b['decode_miss_s']:.2f} s = {1 / b['decode_miss_s']:.2f} tok/s**"),
        (f"**prefill 512**: every expert dequantized once ({b['prefill512_deq_s']:.0f} s) + "
         f"{b['prefill512_flops'] / 1e12:.2f} TFLOP at the sgemm rate", "",
         f"**{b['prefill512_s']:.0f} s = {512 / b['prefill512_s']:.1f} tok/s**"),
    ]
    print("\n| a decode token touches (f32) | bytes | time bound |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def report_file(title: str, col: dict, ref: dict | None, b: dict, cost: dict, lim: dict, logits_dir: Path,
                stem: str) -> None:
    """One file's tables: the figures side by side, against the machine's limits, colichat's expert cache and
    routing, against the numpy bound."""
    c, r = rates(col), rates(ref)
    print(f"### {title}\n")
    for name, run in (("colichat", col), ("llama.cpp", ref)):
        if run and "error" in run:
            print(f"{name} failed: {run['error']}\n")
    print(common.side_by_side(FIGURES, c, r if ref else None).rstrip())
    print("| CPU share other processes used, per phase (" + ", ".join(PHASES) + ") | "
          + " | ".join(" / ".join(f"{x[p]['others_cpu']:.2f}" for p in PHASES) if rates(x) else "-"
                       for x in ([col, ref] if ref else [col])) + (" | |" if ref else " |") + "\n")
    print(machine.limits_table(cost, lim, c, r, [("decode_steady", f"decode tokens {FIRST + 1}-{DECODE} (steady)",
                                                 512 + DECODE)], [("prefill512", "prefill 512")]))
    if not c:
        return
    biased = "biased_share" in col["prefill512"]
    print(f"\ncolichat: {col['memory']}" + common.kernels_note(col))
    if "hits" not in col["prefill512"]:  # experts multiplied in the map: no cache of colichat's own to report
        return
    print(f"expert cache {col['expert_cache_mib']:,} MiB\n")
    print("| colichat phase | expert hits | misses | hit rate | prefetched | next-layer prediction right "
          "| routes to each layer's top 20% of experts |" + (" to the 13 biased |" if biased else "")
          + "\n|---|---|---|---|---|---|---|" + ("---|" if biased else ""))
    for p in PHASES:
        q = col[p]
        right = f"{q['predicted_right'] / q['predictions']:.0%}" if q.get("predictions") else "-"
        print(f"| {p} | {q['hits']} | {q['misses']} | {q['hits'] / max(1, q['hits'] + q['misses']):.0%} | "
              f"{q.get('prefetched', 0)} | {right} | "
              f"{common.cell(q.get('top20_share'))} |" + (f" {q['biased_share']:.2f} |" if biased else ""))
    steady = col["decode_steady"]
    h = steady["hits"] / max(1, steady["hits"] + steady["misses"])
    at_h = b["decode_hit_s"] + (1 - h) * (b["decode_miss_s"] - b["decode_hit_s"])
    print("\n| against the numpy limit | colichat | bound | colichat's speed / the bound's |\n|---|---|---|---|\n"
          f"| decode steady, s/token (bound at its hit rate, {h:.0%}) | {1 / c['decode_steady']:.2f} | {at_h:.2f} "
          f"| {at_h * c['decode_steady']:.0%} |\n| prefill 512, s | {512 / c['prefill512']:.0f} | "
          f"{b['prefill512_s']:.0f} | {b['prefill512_s'] * c['prefill512'] / 512:.0%} |")
    if r:
        print("\ncorrelation of colichat's last logits with llama.cpp's, per phase: "
              + common.correlations(logits_dir, stem, PHASES))
    print()


# --- main ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vs-llamacpp", metavar="PYTHON", help="a python with llama-cpp-python 0.3.36: run it too")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--skewed-only", action="store_true", help="only the skewed-routing file")
    only.add_argument("--uniform-only", action="store_true", help="only the uniform-routing file")
    p.add_argument("--shape", choices=SHAPES, default="v2lite", help="the model shape: DeepSeek-V2-Lite's (default) "
                   "or GLM-4.7-Flash's")
    p.add_argument("--layers", type=int, help="layers of the file (default: the shape's, 27 or 47; 3 for a smoke run)")
    p.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "colichat-bench", help="where the files go")
    p.add_argument("--skew-bias", type=float, default=SKEW_BIAS, help=f"the hot experts' bias ({SKEW_BIAS})")
    p.add_argument("--expert-cache", type=float, help="colichat's expert cache in MiB (default: the engine's)")
    p.add_argument("--prefetch", action="store_true", help="colichat with its next-layer expert prefetch (off by "
                   "default)")
    p.add_argument("--load-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to colichat's engine.load (e.g. kernels=numpy), repeatable")
    p.add_argument("--moe", action="store_true", help=argparse.SUPPRESS)  # make bench ARGS=--moe passes it on
    p.add_argument("--child", nargs=3, metavar=("ENGINE", "GGUF", "TOKENS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.layers = args.layers or SHAPES[args.shape]
    if args.prefetch:  # (the children inherit it)
        os.environ["COLICHAT_BENCH_PREFETCH"] = "1"
    if args.child:  # one engine on one file: its figures as JSON on the last line
        print(json.dumps(child(*args.child, args.expert_cache, dict(a.split("=", 1) for a in args.load_arg))))
        return 0
    t0, load0 = time.perf_counter(), os.getloadavg()
    say(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; measuring the machine")
    lim = measure_limits()
    runs, tmp = {}, tempfile.TemporaryDirectory(prefix="colichat-moe-")
    logits_dir = Path(tmp.name)
    tok_file = logits_dir / "tokens.json"
    tok_file.write_text(json.dumps(token_ids(spec_for(args.layers, False, args.shape).n_vocab)))
    for label in ("uniform", "skewed"):
        if args.skewed_only and label == "uniform" or args.uniform_only and label == "skewed":
            continue
        path = model_file(args.dir, args.layers, label == "skewed", args.skew_bias, args.shape)
        cache = ["--expert-cache", str(args.expert_cache)] if args.expert_cache else []
        cache += [f"--load-arg={a}" for a in args.load_arg]
        say(f"{label}: colichat")
        col = common.run_child([sys.executable, __file__, "--child", "colichat", str(path), str(tok_file), *cache])
        ref = None
        lite = args.shape == "v2lite"  # (no q_lora: llama.cpp's is_lite needs 26 or 27 layers)
        if args.vs_llamacpp and lite and args.layers not in (26, 27):
            ref = {"error": "not run: llama.cpp 0.3.36 takes a deepseek2 file without q_lora only at 26 or 27 layers"}
        elif args.vs_llamacpp:
            say(f"{label}: llama.cpp")
            ref = common.run_child([args.vs_llamacpp, __file__, "--child", "llamacpp", str(path), str(tok_file)])
        runs[label] = (path, col, ref)
    say("measuring the machine again")
    lim = machine.faster(lim, measure_limits())
    lim["kernels"] = machine.measure_kernels()
    b = bounds(spec_for(args.layers, False, args.shape), lim)
    load1 = os.getloadavg()
    print(f"## MoE at the real size: {args.shape}-shaped, {args.layers} layers, random blocks\n\n"
          f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; load average (1/5/15 min) before "
          f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}\n")
    report_limits(lim, b)
    summary = {"shape": args.shape, "layers": args.layers, "limits": lim, "bounds": b, "loadavg": [load0, load1]}
    for label, (path, col, ref) in runs.items():
        bias = f", selection bias {args.skew_bias} on {HOT} of 64 experts per layer" if label == "skewed" else ""
        title = f"{label} routing: {path.name}, {path.stat().st_size / 1e9:.1f} GB{bias}"
        cost = machine.token_cost(path)
        report_file(title, col, ref, b, cost, lim, logits_dir, path.stem)
        summary[label] = {"colichat": rates(col), "llamacpp": rates(ref), "colichat_run": col, "llamacpp_run": ref,
                          "cost": cost}
    tmp.cleanup()
    summary["run_s"] = time.perf_counter() - t0
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
