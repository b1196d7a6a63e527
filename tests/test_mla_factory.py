"""The deepseek2 GGUF factory writes what it claims: the reference vocabulary, the stated shapes,
values independent of layout, and big files without holding them in memory."""

from __future__ import annotations

import gguf
import numpy as np
from conftest import TINY
from gguf_factory import (
    CHAT_TEMPLATE,
    V2_LITE_DENSE,
    DS2Spec,
    tensor_shapes,
    tensor_values,
    vocabulary,
    write_deepseek2,
)


def test_default_vocabulary_is_the_reference_one():
    ref = gguf.GGUFReader(str(TINY / "ds-v3.gguf")).fields
    tokens, types, merges = vocabulary(268)
    assert tokens == ref["tokenizer.ggml.tokens"].contents()
    assert types == ref["tokenizer.ggml.token_type"].contents()
    assert merges == ref["tokenizer.ggml.merges"].contents()
    assert CHAT_TEMPLATE == ref["tokenizer.chat_template"].contents()
    big, _, big_merges = vocabulary(102400)
    assert len(big) == 102400 and len(set(big)) == 102400 and len(big_merges) == 102400 - 260


def test_written_values_follow_the_recipe(tmp_path):
    spec = DS2Spec(split=False, qtype="F32")
    reader = gguf.GGUFReader(str(write_deepseek2(tmp_path / "m.gguf", spec)))
    assert [t.name for t in reader.tensors] == [n for n, _ in tensor_shapes(spec)]
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        assert np.array_equal(np.asarray(t.data), tensor_values(spec, t.name, shape)), t.name


def test_v2_lite_spec_shapes():
    shapes = dict(tensor_shapes(V2_LITE_DENSE))
    assert shapes["token_embd.weight"] == (102400, 2048)
    assert shapes["blk.26.attn_q.weight"] == (16 * 192, 2048)
    assert shapes["blk.26.attn_kv_a_mqa.weight"] == (576, 2048)
    assert shapes["blk.26.attn_k_b.weight"] == (16, 512, 128)
    assert shapes["blk.26.attn_v_b.weight"] == (16, 128, 512)
    assert shapes["blk.26.ffn_gate.weight"] == (10944, 2048)
    assert not any("exps" in n for n in shapes)
