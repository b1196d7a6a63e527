"""Routed experts stay quantized: a model whose experts would need 6.2 GiB as f32 runs in far less.

A generated deepseek2 file with three MoE layers of 64 experts of DeepSeek-V2-Lite's expert shape
(hidden 2048, expert width 1408), Q8_0 (1.7 GiB on disk). A subprocess loads it with a 256 MiB
expert cache, prefills and decodes a few tokens, and reports its peak RSS (ru_maxrss), which counts
the memory-mapped file pages it touched as well as what it allocated.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gguf_factory import DS2Spec, write_deepseek2

pytestmark = pytest.mark.process  # every test here starts a process or a terminal

SPEC = DS2Spec(
    n_layer=3, n_dense=0, n_embd=2048, n_head=2, q_lora_rank=0, kv_lora_rank=64, qk_nope=32, qk_rope=32,
    v_head=32, n_expert=64, n_expert_used=6, n_expert_shared=0, n_ff_exp=1408, gating=1, probs_bias=False,
    n_group=0, weights_norm=False, weights_scale=1.0, qtype="Q8_0", raw_quant=True,
)
EXPERT_CACHE_MIB = 256

CHILD = """
import json, resource, sys
import numpy as np
from colichat.engine.architectures import load_config
from colichat.engine.gguf.tensors import Tensors, open_gguf
from colichat.engine.model import Model, prepare_weights
path, mib = sys.argv[1], float(sys.argv[2])
reader = open_gguf(path)
tensors = Tensors(reader, path)
cfg = load_config(reader, path, tensors)
m = Model(cfg, prepare_weights(cfg, tensors), None, 64, tensors, expert_cache=mib)
logits = m.prefill([1, 2, 3, 4], all_logits=False)
for _ in range(3):
    logits = m.decode(int(np.argmax(logits.reshape(-1))))
est = m.memory_estimate()
print(json.dumps({
    "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "finite": bool(np.isfinite(logits).all()), "misses": m.experts.misses, "cached": m.experts.bytes,
    "estimate": str(est), "experts_f32": est.experts_f32, "bound": est.experts, "total": est.total,
}))
"""


def test_routed_experts_are_not_dequantized_up_front(tmp_path):
    path = tmp_path / "moe-v2lite-experts.gguf"
    try:
        write_deepseek2(path, SPEC)
        file_bytes = path.stat().st_size
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(EXPERT_CACHE_MIB)],
            capture_output=True, text=True, timeout=120, check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        path.unlink(missing_ok=True)
    f32_experts = 3 * 64 * 3 * 1408 * 2048 * 4
    assert r["finite"] and r["misses"] > 0
    assert r["experts_f32"] == f32_experts and r["bound"] == EXPERT_CACHE_MIB << 20
    assert r["cached"] <= EXPERT_CACHE_MIB << 20
    # peak RSS: below the file size plus the cache bound plus ~300 MiB of interpreter and scratch,
    # and far below what dequantizing every expert would take (f32 experts > 1.5 x peak RSS)
    assert r["maxrss"] < file_bytes + (EXPERT_CACHE_MIB << 20) + (300 << 20), r
    assert f32_experts > 1.5 * r["maxrss"], r
    print(f"peak RSS {r['maxrss'] / 2**20:.0f} MiB; {r['estimate']}")
