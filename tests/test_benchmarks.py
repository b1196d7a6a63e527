"""The benchmarks' own parts: the llama writer of gguf_factory (the Llama-3.1-8B shape, a small file colichat
loads), what a token costs read from a file's header, the side-by-side ratios, and benchmarks/ in the shape
issue 46 asks (a common module, imports in one direction, no file over 500 lines)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf_factory import LLAMA_8B, LlamaSpec, llama3_rope_factors, llama_tensors, write_llama

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import common  # noqa: E402
import dense  # noqa: E402
import machine  # noqa: E402


def test_llama_8b_spec_is_llama_3_1_8b_shaped():
    shapes = dict(llama_tensors(LLAMA_8B))
    assert len(shapes) == 4 + 9 * 32
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (128256, 4096)
    assert shapes["blk.31.attn_q.weight"] == (32 * 128, 4096)
    assert shapes["blk.31.attn_k.weight"] == shapes["blk.31.attn_v.weight"] == (8 * 128, 4096)
    assert shapes["blk.0.ffn_gate.weight"] == (14336, 4096) and shapes["blk.0.ffn_down.weight"] == (4096, 14336)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert 8.02e9 < params < 8.04e9  # Llama-3.1-8B: 8.03 B


def test_a_small_llama_file_has_the_stated_types_and_loads(tmp_path):
    spec = LlamaSpec()
    path = write_llama(tmp_path / "l.gguf", spec)
    r = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.1.attn_q.weight"] == types["token_embd.weight"] == "Q4_K"
    assert types["blk.1.ffn_down.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.1.attn_norm.weight"] == types["rope_freqs.weight"] == "F32"
    assert r.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    rope = next(t for t in r.tensors if t.name == "rope_freqs.weight").data
    assert np.array_equal(rope, llama3_rope_factors(spec)) and rope[0] == 1.0 and rope[-1] == 8.0

    from colichat.engine import load

    m = load(str(path), n_ctx=64)
    assert (m.cfg.arch, m.cfg.n_layer, m.cfg.n_head_kv, m.cfg.rope_base) == ("llama", 2, 2, 500000.0)
    logits = m.prefill([300, 301, 302], all_logits=False)
    assert logits.shape[-1] == spec.n_vocab and np.isfinite(logits).all()


def test_a_token_reads_every_tensor_but_one_embedding_row(tmp_path):
    spec = LlamaSpec()
    path = write_llama(tmp_path / "l.gguf", spec)
    r = gguf.GGUFReader(str(path))
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    expected = sum(int(t.n_bytes) for t in r.tensors) - int(embd.n_bytes) + int(embd.n_bytes) // spec.n_vocab
    cost = machine.token_cost(path)
    assert cost["weight_bytes"] == expected
    layer = 2 * spec.n_embd * spec.n_embd + 2 * spec.n_embd * spec.n_embd // 2 + 3 * spec.n_embd * spec.n_ff
    assert cost["params"] == spec.n_layer * layer + spec.n_vocab * spec.n_embd  # the layers and the output head
    assert cost["kv_bytes_per_token"] == 2 * 2 * spec.n_layer * spec.n_head_kv * spec.head_dim  # f16 K and V
    assert cost["prefill_flops"] == 2 * spec.n_layer * layer  # the head: the last token's logits only
    lim = {"read_gbps": 10.0, "sgemm_gflops": 100.0}
    assert machine.decode_bound(cost, lim, 0) == 10e9 / expected


def test_the_harness_restores_the_never_stopped_logits(tmp_path, default_model_path):
    engine = common.colichat(default_model_path, 256, str(tmp_path))
    r = dense.restore(engine, list(range(300, 364)), 400, reps=1)
    assert r["identical"] and r["tokens"] == 64 and r["state_bytes"] > 64 * engine.model().cache.record_bytes


def test_ratios_are_speeds_for_rates_and_times_and_sizes_for_memory():
    figures = [("rate", "r", "rate"), ("time", "t", "time"), ("size", "s", "size")]
    table = common.side_by_side(figures, {"rate": 1.0, "time": 4.0, "size": 3.0},
                                {"rate": 4.0, "time": 1.0, "size": 2.0})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[-1] for line in table.splitlines()[2:]}
    assert rows == {"r": "**0.250** |", "t": "**0.250** |", "s": "**1.500** |"}


def test_benchmarks_import_one_way_and_no_file_is_over_500_lines():
    files = {p.stem: p for p in BENCH.glob("*.py")}
    over = {name: n for name, p in files.items() if (n := len(p.read_text().splitlines())) > 500}
    assert not over
    imports = {name: set() for name in files}
    for name, p in files.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                imports[name] |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module in files:
                imports[name].add(node.module)

    def reaches(a: str, b: str, seen: set) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n})) for n in imports[a])

    assert not [name for name in files if reaches(name, name, set())]
    assert "common" in imports["moe"] and "common" in imports["bench"] and "common" in imports["dense"]
