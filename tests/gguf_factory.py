"""Write small (or big) random deepseek2 and llama GGUF files for tests and benchmarks.

    from gguf_factory import DS2Spec, V2_LITE_DENSE, write_deepseek2
    path = write_deepseek2(tmp_path / "m.gguf", DS2Spec(q_lora_rank=32, n_expert=8, qtype="Q8_0"))
    big = write_deepseek2("/tmp/v2lite.gguf", V2_LITE_DENSE, n_layer=8)   # overrides as keywords

`DS2Spec` holds every option (sizes, q_lora or `attn_q`, split `attn_k_b`/`attn_v_b` or legacy
`attn_kv_b`, leading dense layers, experts/groups/gating/bias/norm/scale, shared experts, YaRN,
tied output, quant type, vocabulary size, architecture name, SwiGLU or squared-ReLU dense FFN, the
lightning indexer of deepseek32 / glm-dsa, MTP blocks); `write_deepseek2(path, spec)` writes it.
`PLM_1_8B` is PLM-1.8B's layout (architecture `plm`).

Weights are a pure function of (spec.seed, tensor name[, expert]): two files that differ only in
layout (split vs legacy, F32 vs Q8_0, tied or not) carry the same underlying values, so their logits
can be compared. Tensors are generated and written one at a time (3-D expert tensors one expert at
a time), so writing a multi-GB file needs memory for one tensor or one expert only.
`raw_quant=True` fills tensors of the types in RAW_TYPES (Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_K, Q6_K) with random
blocks directly (random codes, one fixed fp16 scale): no f32 weights and no quantizer, so it is much
faster for big files and works for types gguf-py cannot quantize (IQ4_NL); the values then no
longer follow the f32 recipe.

The vocabulary is byte-level BPE (gpt2 model, deepseek-v3 pre-tokenizer): 256 byte tokens, four
DeepSeek-style specials (ids 256-259: bos, eos, User, Assistant), then merge tokens. With the
default n_vocab = 268 it is exactly the vocabulary of the reference tiny models; a bigger n_vocab
adds deterministic merges (two-byte, then three-byte tokens) up to the requested size.

`write_llama(path, spec)` writes a llama-3-style file of a `LlamaSpec` the same streaming way, every matrix
random blocks of a RAW_TYPES type, norms f32, llama-3.1's rope_freqs, and this byte-level vocabulary with
llama-3's specials (ids 256-260) under the llama-bpe pre-tokenizer. `LLAMA_8B` is Llama-3.1-8B's shape
(5.1 GB: Q4_K, ffn_down and output Q6_K); llama.cpp 0.3.36 loads it.

Shapes in comments are numpy shapes (reversed ggml ne).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

# block types whose only float field is a leading fp16 scale, with the std of their codes
RAW_TYPES = {"Q8_0": 74.0, "Q4_0": 4.6, "Q5_0": 9.2, "IQ4_NL": 67.0, "Q4_K": 150.0, "Q6_K": 600.0}
# where a raw type keeps its fp16 scales in a block, as multiples of the scale: Q4_K's dmin at 7.5 d
# centres its values (mean of sc * q = 7.5 x mean of m); the default is d in the first two bytes
RAW_SCALES = {"Q4_K": ((0, 1.0), (2, 7.5)), "Q6_K": ((208, 1.0),)}
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
BASE_MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "Ġt he", "o n", "Ġ s"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


@dataclass(frozen=True)
class DS2Spec:
    """A deepseek2 model to write. Defaults: a tiny V3-like model (q_lora, MoE after one dense layer)."""

    arch: str = "deepseek2"       # general.architecture (and the key prefix); change it to test refusals
    n_layer: int = 3
    n_embd: int = 64
    n_head: int = 4
    q_lora_rank: int = 32         # 0: `attn_q` ("lite") instead of attn_q_a/attn_q_a_norm/attn_q_b
    kv_lora_rank: int = 32
    qk_nope: int = 16
    qk_rope: int = 8
    v_head: int = 16
    n_ff: int = 96                # dense FFN width (leading dense layers)
    n_dense: int = 1              # leading dense layers; n_dense >= n_layer + n_nextn: no MoE at all
    n_expert: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 32
    gating: int = 2               # 1 softmax, 2 sigmoid (expert_gating_func); 0: do not write the key
    probs_bias: bool = True       # exp_probs_b.bias selection bias
    n_group: int = 4              # expert_group_count; 0: do not write the keys
    n_group_used: int = 2
    weights_norm: bool = True     # expert_weights_norm
    weights_scale: float = 2.5    # expert_weights_scale
    split: bool = True            # attn_k_b/attn_v_b (+ *_mla keys); False: legacy attn_kv_b
    rope_base: float = 10000.0
    yarn_factor: float = 0.0      # > 0: rope.scaling.type yarn with this factor
    yarn_orig_ctx: int = 64
    yarn_log_mul: float = 0.1     # stored value (0.1 * mscale_all_dim)
    context_length: int = 4096
    rms_eps: float = 1e-6
    tied_output: bool = False     # no output.weight
    n_vocab: int = 268
    qtype: str = "F32"            # type of the matrices (norms, router and bias stay F32, as converters do)
    qtypes: dict = field(default_factory=dict)  # per-tensor-suffix override, e.g. {"attn_k_b": "Q5_0"}
    raw_quant: bool = False       # RAW_TYPES tensors get random blocks directly (fast; IQ4_NL)
    seed: int = 0
    extra_keys: dict = field(default_factory=dict)      # extra metadata {key: value} (value type inferred)
    drop: tuple = ()              # tensor names to leave out (bad-file tests)
    reshape: dict = field(default_factory=dict)         # {tensor name: wrong numpy shape}
    extra_tensors: dict = field(default_factory=dict)   # {name: numpy shape} more F32 tensors
    shards: int = 1               # > 1: a split model, PATH-0000N-of-0000M.gguf (gguf-split naming)
    merged_gate_up: bool = False  # ffn_gate_up_exps (E, 2F, D) instead of ffn_gate_exps + ffn_up_exps
    relu2_ffn: bool = False       # dense layers: ffn_up -> relu^2 -> ffn_down, no ffn_gate (plm)
    index_heads: int = 0          # > 0 (with arch deepseek32 / glm-dsa): the lightning indexer's Hi
    index_dim: int = 64           # Di
    index_top_k: int = 8          # K
    index_types: tuple = ()       # glm-dsa attention.indexer.types (empty: not written; all full)
    n_nextn: int = 0              # MTP blocks after the trunk (block_count counts them)

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope


# DeepSeek-V2-Lite's attention and sizes with a dense FFN in every layer and a real-size vocabulary:
# 2.6 GiB as Q8_0 (random blocks, written in ~10 s with ~0.5 GiB of memory); 10.4 GiB once loaded.
V2_LITE_DENSE = DS2Spec(
    n_layer=27, n_embd=2048, n_head=16, q_lora_rank=0, kv_lora_rank=512, qk_nope=128, qk_rope=64,
    v_head=128, n_ff=10944, n_dense=27, n_vocab=102400, context_length=163840, yarn_factor=40.0,
    yarn_orig_ctx=4096, yarn_log_mul=0.0707, qtype="Q8_0", raw_quant=True,
)

# PLM-1.8B's layout (architecture plm: no q compression, legacy attn_kv_b, squared-ReLU FFN, output
# tied to token_embd) and sizes: 1.8 GiB as Q8_0 (random blocks), 6.8 GiB once loaded (f32).
PLM_1_8B = DS2Spec(
    arch="plm", n_layer=32, n_embd=2048, n_head=16, q_lora_rank=0, kv_lora_rank=512, qk_nope=128,
    qk_rope=64, v_head=128, n_ff=8192, n_dense=32, n_vocab=151936, split=False, tied_output=True,
    relu2_ffn=True, context_length=4096, qtype="Q8_0", raw_quant=True,
)


# --- vocabulary ------------------------------------------------------------------------------------


def byte_chars() -> list[str]:
    """GPT-2 byte -> unicode map: printable bytes map to themselves, the other 68 to U+0100 + n."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + n)
            n += 1
    return [out[b] for b in range(256)]


def vocabulary(n_vocab: int, specials: list[str] = SPECIALS) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary of n_vocab tokens: the 256 bytes, the
    specials, then merges."""
    chars = byte_chars()
    tokens = chars + specials
    types = [1] * 256 + [3] * len(specials)
    merges: list[str] = []
    seen = set(tokens)

    def add(left: str, right: str) -> bool:
        if len(tokens) >= n_vocab or left + right in seen:
            return len(tokens) < n_vocab
        tokens.append(left + right)
        types.append(1)
        merges.append(f"{left} {right}")
        seen.add(left + right)
        return len(tokens) < n_vocab

    for m in BASE_MERGES:
        if not add(*m.split(" ")):
            return tokens, types, merges
    pairs = [a + b for a in chars for b in chars]
    for a in chars:
        for b in chars:
            if not add(a, b):
                return tokens, types, merges
    for p in pairs:
        for c in chars:
            if not add(p, c):
                return tokens, types, merges
    return tokens, types, merges


# --- tensors -----------------------------------------------------------------------------------------


def _rng(seed: int, name: str, expert: int = -1) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), expert + 1])


def _init(spec: DS2Spec, name: str, shape: tuple, expert: int = -1) -> np.ndarray:
    """Deterministic random f32 values for one tensor (or one expert slice of a 3-D tensor)."""
    rng = _rng(spec.seed, name, expert)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("exp_probs_b.bias"):
        return (0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name == "token_embd.weight":
        return rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[-1]
    if name.endswith("attn_k_b.weight"):  # (H, C, Dn) = per head W_UK^T: fan-in is C
        fan_in = shape[-2]
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= np.float32(1.0 / np.sqrt(fan_in))
    return w


def _qtype_of(spec: DS2Spec, name: str, ndim: int, row: int) -> gguf.GGMLQuantizationType:
    base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if ndim == 1 or base == "ffn_gate_inp":
        return gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[spec.qtypes.get(base, spec.qtype)]
    if row % gguf.GGML_QUANT_SIZES[qtype][0]:  # rows that blocks cannot tile: F16, as llama-quant does
        return gguf.GGMLQuantizationType.F16
    return qtype


@dataclass
class _Plan:
    name: str
    shape: tuple          # numpy shape
    qtype: gguf.GGMLQuantizationType

    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        n = int(np.prod(self.shape))
        return n // block * size


def tensor_shapes(spec: DS2Spec) -> list[tuple[str, tuple]]:
    """(name, numpy shape) of every tensor of the spec, in file order."""
    d, h, c, r = spec.n_embd, spec.n_head, spec.kv_lora_rank, spec.qk_rope
    dn, dv, k, v = spec.qk_nope, spec.v_head, spec.qk_head, spec.n_vocab
    out = [("token_embd.weight", (v, d)), ("output_norm.weight", (d,))]
    if not spec.tied_output:
        out.append(("output.weight", (v, d)))
    for l in range(spec.n_layer + spec.n_nextn):
        b = f"blk.{l}."
        out.append((b + "attn_norm.weight", (d,)))
        full = not spec.index_types or spec.index_types[l] if l < spec.n_layer else False
        if spec.index_heads and full:
            hi, di = spec.index_heads, spec.index_dim
            out += [(b + "indexer.k_norm.weight", (di,)), (b + "indexer.k_norm.bias", (di,)),
                    (b + "indexer.proj.weight", (hi, d)), (b + "indexer.attn_k.weight", (di, d)),
                    (b + "indexer.attn_q_b.weight", (hi * di, spec.q_lora_rank or d))]
        if l >= spec.n_layer:
            out += [(b + "nextn.eh_proj.weight", (d, 2 * d)), (b + "nextn.enorm.weight", (d,)),
                    (b + "nextn.hnorm.weight", (d,)), (b + "nextn.shared_head_norm.weight", (d,)),
                    (b + "nextn.shared_head_head.weight", (v, d))]
        if spec.q_lora_rank:
            rq = spec.q_lora_rank
            out += [(b + "attn_q_a.weight", (rq, d)), (b + "attn_q_a_norm.weight", (rq,))]
            out.append((b + "attn_q_b.weight", (h * k, rq)))
        else:
            out.append((b + "attn_q.weight", (h * k, d)))
        out += [(b + "attn_kv_a_mqa.weight", (c + r, d)), (b + "attn_kv_a_norm.weight", (c,))]
        if spec.split:
            out += [(b + "attn_k_b.weight", (h, c, dn)), (b + "attn_v_b.weight", (h, dv, c))]
        else:
            out.append((b + "attn_kv_b.weight", (h * (dn + dv), c)))
        out += [(b + "attn_output.weight", (d, h * dv)), (b + "ffn_norm.weight", (d,))]
        if l < spec.n_dense:
            f = spec.n_ff
            if not spec.relu2_ffn:
                out.append((b + "ffn_gate.weight", (f, d)))
            out += [(b + "ffn_up.weight", (f, d)), (b + "ffn_down.weight", (d, f))]
            continue
        e, fe = spec.n_expert, spec.n_ff_exp
        out.append((b + "ffn_gate_inp.weight", (e, d)))
        if spec.probs_bias:
            out.append((b + "exp_probs_b.bias", (e,)))
        if spec.merged_gate_up:
            out.append((b + "ffn_gate_up_exps.weight", (e, 2 * fe, d)))
        else:
            out += [(b + "ffn_gate_exps.weight", (e, fe, d)), (b + "ffn_up_exps.weight", (e, fe, d))]
        out.append((b + "ffn_down_exps.weight", (e, d, fe)))
        if spec.n_expert_shared:
            fs = fe * spec.n_expert_shared
            out += [(b + "ffn_gate_shexp.weight", (fs, d)), (b + "ffn_up_shexp.weight", (fs, d))]
            out.append((b + "ffn_down_shexp.weight", (d, fs)))
    out += list(spec.extra_tensors.items())
    return [(n, tuple(spec.reshape.get(n, s))) for n, s in out if n not in spec.drop]


def tensor_values(spec: DS2Spec, name: str, shape: tuple, expert: int | None = None) -> np.ndarray:
    """The f32 values of a tensor (or of one expert of a 3-D one), the same in every layout."""
    if name.endswith("attn_kv_b.weight") and name not in spec.reshape:
        b = name[: -len("attn_kv_b.weight")]
        h, c, dn, dv = spec.n_head, spec.kv_lora_rank, spec.qk_nope, spec.v_head
        k_b = _init(spec, b + "attn_k_b.weight", (h, c, dn))  # (H, C, Dn)
        v_b = _init(spec, b + "attn_v_b.weight", (h, dv, c))  # (H, Dv, C)
        w3 = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, Dn+Dv, C)
        return np.ascontiguousarray(w3.reshape(h * (dn + dv), c))
    if name.endswith("ffn_gate_up_exps.weight") and name not in spec.reshape:  # [gate; up] per expert
        b = name[: -len("gate_up_exps.weight")]
        parts = [tensor_values(spec, b + f"{n}_exps.weight", (shape[0], shape[1] // 2, shape[2]), expert)
                 for n in ("gate", "up")]
        return np.concatenate(parts, axis=-2)
    if name.endswith("_exps.weight"):  # generated one expert at a time
        if expert is not None:
            return _init(spec, name, shape[1:], expert)
        return np.stack([_init(spec, name, shape[1:], e) for e in range(shape[0])])
    return _init(spec, name, shape)


def raw_blocks(seed: int, name: str, shape: tuple, qtype, expert: int = -1) -> np.ndarray:
    """Random blocks of a RAW_TYPES type for `shape` (one expert of a 3-D tensor, or a whole tensor)."""
    rng = _rng(seed, name, expert)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    blocks = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    # weights of std ~ 1/sqrt(fan_in): code std x scale
    scale = np.float16(1.0 / (RAW_TYPES[qtype.name] * np.sqrt(shape[-1])))
    for offset, times in RAW_SCALES.get(qtype.name, ((0, 1.0),)):
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(scale * times).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def _is_raw(spec: DS2Spec, plan) -> bool:
    return spec.raw_quant and plan.qtype.name in RAW_TYPES


def _encode(spec: DS2Spec, plan: _Plan, values: np.ndarray | None, expert: int) -> np.ndarray:
    if _is_raw(spec, plan):
        shape = plan.shape if expert < 0 else plan.shape[1:]
        return raw_blocks(spec.seed, plan.name, shape, plan.qtype, expert)
    return gguf.quants.quantize(values, plan.qtype)


# --- file --------------------------------------------------------------------------------------------


def metadata(spec: DS2Spec) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """(key, value, type) of every metadata key the spec writes (beside general.architecture)."""
    a, T = spec.arch, gguf.GGUFValueType
    tokens, types, merges = vocabulary(spec.n_vocab)
    kv = [
        ("general.name", "colichat test " + a, T.STRING),
        ("tokenizer.ggml.model", "gpt2", T.STRING),
        ("tokenizer.ggml.pre", "deepseek-v3", T.STRING),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY),
        ("tokenizer.ggml.token_type", types, T.ARRAY),
        ("tokenizer.ggml.merges", merges, T.ARRAY),
        ("tokenizer.ggml.bos_token_id", 256, T.UINT32),
        ("tokenizer.ggml.eos_token_id", 257, T.UINT32),
        ("tokenizer.ggml.add_bos_token", True, T.BOOL),
        ("tokenizer.chat_template", CHAT_TEMPLATE, T.STRING),
        (f"{a}.block_count", spec.n_layer + spec.n_nextn, T.UINT32),
        (f"{a}.context_length", spec.context_length, T.UINT32),
        (f"{a}.embedding_length", spec.n_embd, T.UINT32),
        (f"{a}.feed_forward_length", spec.n_ff, T.UINT32),
        (f"{a}.attention.head_count", spec.n_head, T.UINT32),
        (f"{a}.attention.head_count_kv", 1 if spec.split else spec.n_head, T.UINT32),
        (f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps, T.FLOAT32),
        (f"{a}.vocab_size", spec.n_vocab, T.UINT32),
        (f"{a}.rope.freq_base", spec.rope_base, T.FLOAT32),
        (f"{a}.rope.dimension_count", spec.qk_rope, T.UINT32),
        (f"{a}.leading_dense_block_count", min(spec.n_dense, spec.n_layer + spec.n_nextn), T.UINT32),
        (f"{a}.attention.kv_lora_rank", spec.kv_lora_rank, T.UINT32),
        (f"{a}.expert_feed_forward_length", spec.n_ff_exp, T.UINT32),
        (f"{a}.expert_shared_count", spec.n_expert_shared, T.UINT32),
    ]
    if spec.q_lora_rank:
        kv.append((f"{a}.attention.q_lora_rank", spec.q_lora_rank, T.UINT32))
    c, r = spec.kv_lora_rank, spec.qk_rope
    if spec.split:  # newer converter: MQA-shaped key/value lengths plus the real head sizes
        kv += [
            (f"{a}.attention.key_length", c + r, T.UINT32),
            (f"{a}.attention.value_length", c, T.UINT32),
            (f"{a}.attention.key_length_mla", spec.qk_head, T.UINT32),
            (f"{a}.attention.value_length_mla", spec.v_head, T.UINT32),
        ]
    else:
        kv += [
            (f"{a}.attention.key_length", spec.qk_head, T.UINT32),
            (f"{a}.attention.value_length", spec.v_head, T.UINT32),
        ]
    if spec.n_dense < spec.n_layer:
        kv += [
            (f"{a}.expert_count", spec.n_expert, T.UINT32),
            (f"{a}.expert_used_count", spec.n_expert_used, T.UINT32),
            (f"{a}.expert_weights_scale", spec.weights_scale, T.FLOAT32),
            (f"{a}.expert_weights_norm", spec.weights_norm, T.BOOL),
        ]
        if spec.gating:
            kv.append((f"{a}.expert_gating_func", spec.gating, T.UINT32))
        if spec.n_group:
            kv.append((f"{a}.expert_group_count", spec.n_group, T.UINT32))
            kv.append((f"{a}.expert_group_used_count", spec.n_group_used, T.UINT32))
    if spec.yarn_factor > 0:
        kv += [
            (f"{a}.rope.scaling.type", "yarn", T.STRING),
            (f"{a}.rope.scaling.factor", spec.yarn_factor, T.FLOAT32),
            (f"{a}.rope.scaling.original_context_length", spec.yarn_orig_ctx, T.UINT32),
            (f"{a}.rope.scaling.yarn_log_multiplier", spec.yarn_log_mul, T.FLOAT32),
        ]
    if spec.n_nextn:
        kv.append((f"{a}.nextn_predict_layers", spec.n_nextn, T.UINT32))
    if spec.index_heads:
        kv += [
            (f"{a}.attention.indexer.head_count", spec.index_heads, T.UINT32),
            (f"{a}.attention.indexer.key_length", spec.index_dim, T.UINT32),
            (f"{a}.attention.indexer.top_k", spec.index_top_k, T.UINT32),
        ]
        if spec.index_types:
            kv.append((f"{a}.attention.indexer.types", [int(v) for v in spec.index_types], T.ARRAY))
    for key, val in spec.extra_keys.items():
        kv.append((key, val, gguf.GGUFValueType.get_type(val)))
    return kv


def write_deepseek2(path, spec: DS2Spec | None = None, **overrides) -> Path:
    """Write `spec` (with field overrides) to `path`, streaming one tensor (or expert) at a time.
    Returns the path written (for a split model: the first part)."""
    spec = replace(spec or DS2Spec(), **overrides)
    plans = [_Plan(name, shape, _qtype_of(spec, name, len(shape), shape[-1])) for name, shape in tensor_shapes(spec)]

    def chunks(plan: _Plan):
        experts = range(plan.shape[0]) if plan.name.endswith("_exps.weight") else [None]
        for e in experts:
            values = None if _is_raw(spec, plan) else tensor_values(spec, plan.name, plan.shape, e)
            yield _encode(spec, plan, values, -1 if e is None else e)

    return _stream(path, spec.arch, metadata(spec), plans, chunks, spec.shards)


def _stream(path, arch: str, kv: list, plans: list[_Plan], chunks, shards: int = 1) -> Path:
    """Write a GGUF: the header, then each plan's data from chunks(plan) (arrays whose bytes follow each
    other), one chunk in memory at a time. Returns the path written (for a split model: the first part)."""
    path = Path(path)
    per_shard = -(-len(plans) // shards) if shards > 1 else 0
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=per_shard)
    for key, val, vtype in kv:
        w.add_key_value(key, val, vtype)
    by_name = {}
    for plan in plans:
        by_name[plan.name] = plan
        if plan.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            dtype = np.float32 if plan.qtype == gguf.GGMLQuantizationType.F32 else np.float16
            w.add_tensor_info(plan.name, plan.shape, np.dtype(dtype), plan.nbytes())
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(plan.shape, plan.qtype)
            w.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), plan.nbytes(), raw_dtype=plan.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    first = Path(w.fout[0].name)
    for fout, names in zip(w.fout, w.tensors, strict=True):
        for name in names:
            plan = by_name[name]
            w.write_padding(fout, fout.tell())
            written = 0
            for data in chunks(plan):
                data.tofile(fout)
                written += data.nbytes
            assert written == plan.nbytes(), name
            w.write_padding(fout, written)
    w.close()
    return first


# --- llama -------------------------------------------------------------------------------------------

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
    " + m['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class LlamaSpec:
    """A llama-3-style model to write: every matrix random blocks of its type (a RAW_TYPES type, as
    raw_quant writes them), norms f32, llama-3.1's rope_freqs. Defaults: a tiny model."""

    n_layer: int = 2
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 512
    n_vocab: int = 512
    rope_base: float = 500000.0
    rope_scaling: tuple = (8.0, 1.0, 4.0, 8192)  # llama-3.1 rope_freqs: factor, low, high, original context
    context_length: int = 131072
    rms_eps: float = 1e-5
    qtype: str = "Q4_K"           # matrices
    qtypes: dict = field(default_factory=lambda: {"ffn_down": "Q6_K", "output": "Q6_K"})  # per suffix
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Llama-3.1-8B's shape: every matrix Q4_K but ffn_down and output Q6_K (a Q4_K_M-like mix); 5.1 GB.
LLAMA_8B = LlamaSpec(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)


def llama_tensors(spec: LlamaSpec) -> list[tuple[str, tuple]]:
    """(name, numpy shape) of every tensor of a llama spec, in file order."""
    d, e, f = spec.n_embd, spec.head_dim, spec.n_ff
    out = [("token_embd.weight", (spec.n_vocab, d)), ("output_norm.weight", (d,)),
           ("output.weight", (spec.n_vocab, d)), ("rope_freqs.weight", (e // 2,))]
    for l in range(spec.n_layer):
        b = f"blk.{l}."
        out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (spec.n_head * e, d)),
                (b + "attn_k.weight", (spec.n_head_kv * e, d)), (b + "attn_v.weight", (spec.n_head_kv * e, d)),
                (b + "attn_output.weight", (d, spec.n_head * e)), (b + "ffn_norm.weight", (d,)),
                (b + "ffn_gate.weight", (f, d)), (b + "ffn_up.weight", (f, d)), (b + "ffn_down.weight", (d, f))]
    return out


def llama3_rope_factors(spec: LlamaSpec) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py writes it for llama-3.1 (rope_type llama3). (I,) f32"""
    factor, low, high, old = spec.rope_scaling
    freqs = 1.0 / spec.rope_base ** (np.arange(0, spec.head_dim, 2) / spec.head_dim)  # (I,)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid)).astype(np.float32)


def llama_metadata(spec: LlamaSpec) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """(key, value, type) of every metadata key of a llama spec (beside general.architecture)."""
    T = gguf.GGUFValueType
    tokens, types, merges = vocabulary(spec.n_vocab, LLAMA3_SPECIALS)
    return [
        ("general.name", "colichat test llama", T.STRING),
        ("llama.block_count", spec.n_layer, T.UINT32),
        ("llama.context_length", spec.context_length, T.UINT32),
        ("llama.embedding_length", spec.n_embd, T.UINT32),
        ("llama.feed_forward_length", spec.n_ff, T.UINT32),
        ("llama.attention.head_count", spec.n_head, T.UINT32),
        ("llama.attention.head_count_kv", spec.n_head_kv, T.UINT32),
        ("llama.rope.freq_base", spec.rope_base, T.FLOAT32),
        ("llama.attention.layer_norm_rms_epsilon", spec.rms_eps, T.FLOAT32),
        ("llama.rope.dimension_count", spec.head_dim, T.UINT32),
        ("llama.vocab_size", spec.n_vocab, T.UINT32),
        ("tokenizer.ggml.model", "gpt2", T.STRING),
        ("tokenizer.ggml.pre", "llama-bpe", T.STRING),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY),
        ("tokenizer.ggml.token_type", types, T.ARRAY),
        ("tokenizer.ggml.merges", merges, T.ARRAY),
        ("tokenizer.ggml.bos_token_id", 256, T.UINT32),
        ("tokenizer.ggml.eos_token_id", 257, T.UINT32),
        ("tokenizer.ggml.eot_token_id", 260, T.UINT32),
        ("tokenizer.chat_template", LLAMA3_TEMPLATE, T.STRING),
    ]


def write_llama(path, spec: LlamaSpec | None = None, **overrides) -> Path:
    """Write a llama spec (with field overrides) to `path`, streaming: memory for one tensor at a time."""
    spec = replace(spec or LlamaSpec(), **overrides)
    F32 = gguf.GGMLQuantizationType.F32
    plans = []
    for name, shape in llama_tensors(spec):
        base = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = F32 if len(shape) == 1 else gguf.GGMLQuantizationType[spec.qtypes.get(base, spec.qtype)]
        if qtype != F32 and qtype.name not in RAW_TYPES:
            raise ValueError(f"{name}: write_llama writes random blocks of {', '.join(RAW_TYPES)}, not {qtype.name}")
        plans.append(_Plan(name, shape, qtype))

    def chunks(plan: _Plan):
        if plan.name == "rope_freqs.weight":
            yield llama3_rope_factors(spec)
        elif plan.qtype == F32:  # the norms
            rng = _rng(spec.seed, plan.name)
            yield (1.0 + 0.1 * rng.standard_normal(plan.shape, dtype=np.float32)).astype(np.float32)
        else:
            yield raw_blocks(spec.seed, plan.name, plan.shape, plan.qtype)

    return _stream(path, "llama", llama_metadata(spec), plans, chunks)
