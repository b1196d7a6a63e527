"""Sparse attention (DSA), DeepSeek-V3.2-shaped: decode with the lightning indexer against the same model
attending densely, its verify passes, and one layer's attention alone (random arrays).

    make bench ARGS="--dsa"                 # through bench.py
    .venv/bin/python benchmarks/dsa.py [--quick]

Output: a table on stdout, benchmarks/out/dsa.json and dsa.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculative  # noqa: E402  (benchmarks/speculative.py: verify passes)
from common import OUT, OtherLoad, deepseek2_file, say, table, timed  # noqa: E402
from machine import code_version, machine_info, measure_sgemm  # noqa: E402

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
    from gguf_factory import DS2Spec

    return deepseek2_file(OUT / "v32-shaped-2layers.gguf", DS2Spec(**V32_SHAPED))


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
    cache.tokens[:n] = np.random.default_rng(3).integers(0, model.cfg.n_vocab, n)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    d = bench_dsa(args.quick)
    d.update(machine=machine_info(), date=time.strftime("%Y-%m-%d %H:%M:%S %z"), code=code_version(),
             run_s=time.perf_counter() - t0)
    (OUT / "dsa.json").write_text(json.dumps(d, indent=1))
    (OUT / "dsa.md").write_text(dsa_report(d, markdown=True))
    print(dsa_report(d, markdown=False))
    print(f"run time {d['run_s']:.0f} s; wrote {OUT / 'dsa.json'}, dsa.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
