"""What an expert-cache miss costs: decode of a MoE model whose experts do not stay dequantized.

    .venv/bin/python benchmarks/experts.py           # about a minute; writes a 2.3 GB GGUF to benchmarks/out/

A random deepseek2 GGUF with DeepSeek-V2-Lite's MoE layer shape (64 experts of FFN 1408 over hidden
2048, 6 routed + 2 shared, V2-Lite attention) in 3 layers, experts stored as a "Q4_K_M" file stores
them (gate/up Q4_K, down Q6_K), the rest Q8_0. Decode speed with a 4 GiB expert cache and with a
256 MiB one (almost every routed expert a miss), each with colichat's dequantizers
(engine/gguf/dequant.py) and with gguf-py's, in one run. Nothing is asserted.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # gguf_factory writes the model

SPEC = dict(
    n_layer=3, n_dense=0, n_embd=2048, n_head=16, q_lora_rank=0, kv_lora_rank=512, qk_nope=128, qk_rope=64,
    v_head=128, n_expert=64, n_expert_used=6, n_expert_shared=2, n_ff_exp=1408, gating=1, probs_bias=False,
    n_group=0, weights_norm=False, weights_scale=1.0, qtype="Q8_0", raw_quant=True, n_vocab=102400,
    qtypes={"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"},
)
STEPS = 20


def decode_ms(path: Path, cache_mib: float) -> tuple[float, int]:
    from colichat.engine import load

    m = load(str(path), n_ctx=256, expert_cache=cache_mib)
    rng = np.random.default_rng(0)
    m.prefill(rng.integers(300, 100000, 32), all_logits=False)
    t = time.perf_counter()
    for _ in range(STEPS):
        m.decode(int(rng.integers(300, 100000)))
    return (time.perf_counter() - t) / STEPS * 1000, m.experts.misses


def main() -> None:
    from gguf_factory import DS2Spec, write_deepseek2

    from colichat.engine.gguf import dequant

    path = HERE / "out" / "experts-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        print(f"writing {path} ...", flush=True)
        write_deepseek2(path, DS2Spec(**SPEC))
    fast = dict(dequant.FAST)
    rows = []
    for cache in (4096, 256):
        for name in ("colichat", "gguf-py"):
            dequant.FAST.clear()
            dequant.FAST.update(fast if name == "colichat" else {"Q8_0": fast["Q8_0"]})
            ms, misses = decode_ms(path, cache)
            rows.append((cache, name, ms, misses))
    dequant.FAST.update(fast)
    print("| expert cache | K-quant dequantizer | decode ms/token | expert misses (prefill + decode) |")
    print("|---|---|---|---|")
    for cache, name, ms, misses in rows:
        print(f"| {cache} MiB | {name} | {ms:.0f} | {misses} |")
    for cache in (4096, 256):
        a, b = (r[2] for r in rows if r[0] == cache)
        print(f"{cache} MiB: colichat's dequantizers make decode {b / a:.1f}x faster")


if __name__ == "__main__":
    main()
