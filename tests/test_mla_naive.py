"""The engine's absorbed MLA equals a naive float64 deepseek2 (mla_naive.py, written from the spec
alone): random models of many shapes, decoding token by token, including positions far past the
YaRN original context.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf_factory import DS2Spec, write_deepseek2
from mla_naive import engine, naive_logits, read_tensors, rms, rope

CASES = {
    # V3-like: q_lora, sigmoid + bias, groups, norm, scale 2.5, shared expert, YaRN (orig ctx 16)
    "v3": DS2Spec(yarn_factor=4.0, yarn_orig_ctx=16),
    # V2-Lite-like: attn_q, legacy attn_kv_b, softmax, no groups, no norm, scale 16, 2 shared, tied
    "lite-legacy": DS2Spec(
        q_lora_rank=0, split=False, gating=1, probs_bias=False, n_group=0, weights_norm=False,
        weights_scale=16.0, n_expert_shared=2, tied_output=True, yarn_factor=40.0, yarn_orig_ctx=8,
        yarn_log_mul=0.0707,
    ),
    # all layers dense, odd head sizes, no YaRN; Mistral-Large-3 style query temperature
    "dense-temp": DS2Spec(
        n_dense=3, n_head=3, qk_nope=12, qk_rope=6, v_head=10, kv_lora_rank=24,
        extra_keys={"deepseek2.attention.temperature_scale": 0.5, "deepseek2.attention.temperature_length": 4},
    ),
    # softmax gating with groups and a bias, scale 1 (not applied), Q8_0 weights
    "q8-softmax-groups": DS2Spec(gating=1, n_expert=6, n_group=3, n_group_used=2, weights_scale=1.0, qtype="Q8_0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_decode_equals_naive_attention(tmp_path, case):
    path = write_deepseek2(tmp_path / f"{case}.gguf", CASES[case])
    ids = np.random.default_rng(1).integers(0, 268, size=48)  # 48 positions: 3x..6x past orig ctx
    ref = naive_logits(path, ids)
    m = engine(path)
    steps = np.stack([m.decode(int(i)) for i in ids])  # absorbed, one token at a time
    assert np.abs(steps - ref).max() < 2e-4, np.abs(steps - ref).max(axis=1)
    m.reset()
    whole = m.prefill(ids)  # batched prefill, same cache
    assert np.abs(whole - ref).max() < 2e-4


def test_cache_holds_normalized_latent_and_roped_key(tmp_path):
    """cache.a[l] is kv_a_norm(latent) and cache.b[l] the roped k_pe, nothing derived from them."""
    spec = DS2Spec(yarn_factor=4.0, yarn_orig_ctx=16)
    path = write_deepseek2(tmp_path / "m.gguf", spec)
    m = engine(path)
    ids = np.arange(20) + 40
    m.prefill(ids)
    reader = gguf.GGUFReader(str(path))
    W = read_tensors(reader)
    x = W["token_embd.weight"][ids[-1]]  # layer 0 input of the last token
    u = rms(x, W["blk.0.attn_norm.weight"], spec.rms_eps)
    z = W["blk.0.attn_kv_a_mqa.weight"] @ u
    c = rms(z[: spec.kv_lora_rank], W["blk.0.attn_kv_a_norm.weight"], spec.rms_eps)
    k_pe = rope(z[spec.kv_lora_rank :], 19, spec.qk_rope, spec.rope_base, 4.0, 16, True)
    assert m.cache.a[0].shape[1] == spec.kv_lora_rank and m.cache.b[0].shape[1] == spec.qk_rope
    assert np.abs(m.cache.a[0][19] - c).max() < 1e-5
    assert np.abs(m.cache.b[0][19] - k_pe).max() < 1e-5
    assert m.cache.kv_bytes_per_token == 4 * spec.n_layer * (spec.kv_lora_rank + spec.qk_rope)
