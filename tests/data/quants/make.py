"""Writes two tiny llama files of the quantized types gguf-py cannot write, and llama.cpp's logits for them.

    .venv/bin/python tests/data/quants/make.py write              # the GGUFs, from tests/data/tiny/llama.gguf
    LLAMA_PYTHON tests/data/quants/make.py reference              # a Python with llama-cpp-python 0.3.36

Each GGUF is tests/data/tiny/llama.gguf (4 layers, hidden 256, FFN 512) with its 28 block matrices quantized to
its types in turn (each layer starting one type on), its output matrix Q6_K (268 rows):
- llama.kquants.gguf: Q3_K, Q4_K, Q5_K, IQ4_XS;
- llama.q2q6nl.gguf: Q2_K, Q6_K, IQ4_NL.
(They are apart because llama.cpp multiplies a matrix of the second file's types whose rows are a multiple of
8 with other kernels than one at a time; measured, tests/test_quant_types.py.)
The quantizers here are plain (a sub-block's scale and minimum from its range, the codes rounded to nearest),
not ggml's searches: a valid block is all the test needs, and gguf-py's dequantizer checks each (`write`
fails if one is far from the values it meant). The references, NAME.ref.npz: llama.cpp's logits at every
position of a prefill of 40 random byte tokens (`tokens_0`, `logits_0`) and of its first 16 tokens fed one
at a time (`decode_logits_0`), KV cache f32, flash attention off, n_ctx 1024, 2 threads, as the stored
references of tests/data were made. llama-cpp-python is a measuring instrument here, never a dependency.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "tiny" / "llama.gguf"
FILES = {"llama.kquants": ("Q3_K", "Q4_K", "Q5_K", "IQ4_XS"), "llama.q2q6nl": ("Q2_K", "Q6_K", "IQ4_NL")}
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
F16 = np.float16


def _fp16(v) -> np.ndarray:
    """(n, 2) uint8: the fp16 bytes of v (n,)."""
    return np.asarray(v, np.float32).astype(F16).reshape(-1, 1).view(np.uint8)


def _f(h) -> np.ndarray:
    return np.asarray(h, np.float32).astype(F16).astype(np.float32)  # the value as stored


def _range_scales(w, levels: int, scale_bits: int):
    """Sub-blocks w (n, s, v) with codes 0..levels and a minimum: (d, dmin, sc, m, q) with
    w ~ d sc q - dmin m."""
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    scf, mf = (hi - lo) / levels, -lo
    top = (1 << scale_bits) - 1
    d, dmin = _f(scf.max(-1) / top), _f(mf.max(-1) / top)
    sc = np.clip(np.rint(scf / np.where(d > 0, d, 1)[:, None]), 0, top).astype(np.int32)
    m = np.clip(np.rint(mf / np.where(dmin > 0, dmin, 1)[:, None]), 0, top).astype(np.int32)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint((w + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1)), 0, levels)
    return d, dmin, sc, m, q.astype(np.int32)


def _signed_scales(w, codes: float, scale_top: int):
    """Sub-blocks w (n, s, v) as d sc k, |k| <= codes: (d, sc) with sc in -scale_top-1..scale_top."""
    amax = np.abs(w).max(-1) / codes
    d = _f(amax.max(-1) / scale_top)
    sc = np.clip(np.rint(amax / np.where(d > 0, d, 1)[:, None]), -scale_top - 1, scale_top).astype(np.int32)
    return d, sc


def q4_k(w, fifth=False):
    n = w.shape[0]
    d, dmin, sc, m, q = _range_scales(w.reshape(n, 8, 32), 31 if fifth else 15, 6)
    s = np.zeros((n, 12), np.uint8)
    s[:, :4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    s[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    s[:, 8:] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    q = q.reshape(n, 4, 2, 32)  # (pair c, low/high, l)
    qs = ((q[:, :, 0] & 15) | (q[:, :, 1] & 15) << 4).reshape(n, 128)
    parts = [_fp16(d), _fp16(dmin), s]
    if fifth:
        qh = np.zeros((n, 32), np.int32)
        for j in range(8):
            qh |= (q.reshape(n, 8, 32)[:, j] >> 4) << j
        parts.append(qh)
    return np.concatenate(parts + [qs], axis=1).astype(np.uint8)


def q6_k(w):
    n = w.shape[0]
    d, sc = _signed_scales(w.reshape(n, 16, 16), 32, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(w.reshape(n, 16, 16) / np.where(step != 0, step, 1)) + 32, 0, 63).astype(np.int32)
    q = q.reshape(n, 2, 4, 32)  # (half h, quarter, l): value 128 h + 32 quarter + l
    ql = np.stack([np.concatenate([(q[:, h, 0] & 15) | (q[:, h, 2] & 15) << 4,
                                   (q[:, h, 1] & 15) | (q[:, h, 3] & 15) << 4], axis=1) for h in range(2)], 1)
    qh = np.stack([(q[:, h, 0] >> 4) | (q[:, h, 1] >> 4) << 2 | (q[:, h, 2] >> 4) << 4 | (q[:, h, 3] >> 4) << 6
                   for h in range(2)], 1)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc & 255, _fp16(d)], axis=1).astype(np.uint8)


def q2_k(w):
    n = w.shape[0]
    d, dmin, sc, m, q = _range_scales(w.reshape(n, 16, 16), 3, 4)
    q = q.reshape(n, 2, 4, 32)  # value 128 h + 32 g + l
    qs = np.stack([q[:, h, 0] | q[:, h, 1] << 2 | q[:, h, 2] << 4 | q[:, h, 3] << 6 for h in range(2)], 1)
    return np.concatenate([sc | m << 4, qs.reshape(n, 64), _fp16(d), _fp16(dmin)], axis=1).astype(np.uint8)


def q3_k(w):
    n = w.shape[0]
    d, sc = _signed_scales(w.reshape(n, 16, 16), 4, 31)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.rint(w.reshape(n, 16, 16) / np.where(step != 0, step, 1)) + 4, 0, 7).astype(np.int32)
    q = q.reshape(n, 2, 4, 32)
    qs = np.stack([(q[:, h, 0] & 3) | (q[:, h, 1] & 3) << 2 | (q[:, h, 2] & 3) << 4 | (q[:, h, 3] & 3) << 6
                   for h in range(2)], 1)
    hmask = np.zeros((n, 32), np.int32)
    for h in range(2):
        for g in range(4):
            hmask |= (q[:, h, g] >> 2) << (4 * h + g)
    u = sc + 32  # six bits
    s = np.zeros((n, 12), np.int32)
    s[:, :8] = (u[:, :8] & 15) | (u[:, 8:] & 15) << 4
    for i in range(16):
        s[:, 8 + i % 4] |= (u[:, i] >> 4) << (2 * (i // 4))
    return np.concatenate([hmask, qs.reshape(n, 64), s, _fp16(d)], axis=1).astype(np.uint8)


def _iq4_codes(w, step):
    """The nearest IQ4_VALUES index of w / step (w (..., v), step (..., 1))."""
    return np.abs(w[..., None] / np.where(step != 0, step, 1)[..., None] - IQ4_VALUES).argmin(-1).astype(np.int32)


def _nibbles(codes):
    """(..., 32) codes -> (..., 16) bytes: code j low, code 16 + j high."""
    return codes[..., :16] | codes[..., 16:] << 4


def iq4_xs(w):
    n = w.shape[0]
    d, sc = _signed_scales(w.reshape(n, 8, 32), 127, 31)
    codes = _iq4_codes(w.reshape(n, 8, 32), (d[:, None] * sc)[..., None])
    u = sc + 32
    high = np.zeros(n, np.int32)
    for j in range(8):
        high |= (u[:, j] >> 4) << (2 * j)
    low = (u[:, 0::2] & 15) | (u[:, 1::2] & 15) << 4
    return np.concatenate([_fp16(d), high.astype("<u2").view(np.uint8).reshape(n, 2), low,
                           _nibbles(codes).reshape(n, 128)], axis=1).astype(np.uint8)


def iq4_nl(w):
    n, z = w.shape
    blocks = w.reshape(n * z // 32, 32)
    d = _f(np.abs(blocks).max(-1) / 127)
    codes = _iq4_codes(blocks, d[:, None])
    return np.concatenate([_fp16(d), _nibbles(codes)], axis=1).astype(np.uint8).reshape(n, -1)


def quantize(name: str, w: np.ndarray) -> np.ndarray:
    """(R, Z) float32 -> (R, row bytes) uint8 of type `name`."""
    r, z = w.shape
    per = 32 if name == "IQ4_NL" else 256
    rows = w.reshape(-1, per)
    f = {"Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": lambda v: q4_k(v, True), "Q6_K": q6_k,
         "IQ4_XS": iq4_xs, "IQ4_NL": iq4_nl}[name]
    return f(rows).reshape(r, -1)


def write_file(path: Path, types: tuple[str, ...]) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    sys.path.insert(0, str(HERE.parent.parent))  # tests/, for quantized_models
    from quantized_models import write_copy

    order = iter(range(1 << 30))  # the block matrices in file order

    def quantized(name: str, w: np.ndarray):
        if w.ndim < 2 or name == "token_embd.weight":
            return None
        if name == "output.weight":
            qtype = "Q6_K"
        else:
            k = next(order)
            qtype = types[(k % 7 + k // 7) % len(types)]  # (7 a layer: each layer one type on)
        raw = quantize(qtype, w)
        err = np.abs(dequantize(raw, Q[qtype]).reshape(w.shape) - w).max() / np.abs(w).max()
        assert err < 0.4, (name, qtype, err)  # (measured: at most 0.28, Q2_K's)
        return raw, Q[qtype]

    write_copy(SOURCE, path, quantized)


def write() -> None:
    for name, types in FILES.items():
        write_file(HERE / f"{name}.gguf", types)


def reference() -> None:
    import llama_cpp

    for name in FILES:
        llm = llama_cpp.Llama(str(HERE / f"{name}.gguf"), n_ctx=1024, logits_all=True, flash_attn=False,
                              verbose=False, n_threads=2, type_k=llama_cpp.GGML_TYPE_F32,
                              type_v=llama_cpp.GGML_TYPE_F32)
        tokens = np.random.default_rng(20261207).integers(4, 260, 40).astype(np.int32)
        llm.reset()
        llm.eval(tokens.tolist())
        logits = np.array(llm.scores[: len(tokens)], np.float32)
        llm.reset()
        decoded = []
        for token in tokens[:16].tolist():
            llm.eval([token])
            decoded.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
        np.savez(HERE / f"{name}.ref.npz", tokens_0=tokens, logits_0=logits, decode_logits_0=np.array(decoded))


if __name__ == "__main__":
    {"write": write, "reference": reference}[sys.argv[1]]()
