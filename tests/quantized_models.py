"""Quantized copies of the tiny reference models, for the kernel path (the tiny GGUFs hold F32 only).

    path = quantized_copy("llama", "Q4_1", tmp_dir)   # tests/data/tiny/llama.gguf, matrices in Q4_1

Every tensor of two or more axes whose rows blocks of the type tile (and that the engine multiplies
as a matrix: not a norm, router or bias) is quantized with gguf-py's quantizer; the rest is copied.
The copy is the same model with rounded weights: both kernel paths run it, and their logits agree
closely (the values multiplied are the same; only the order of the sums differs).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TINY = Path(__file__).resolve().parent / "data" / "tiny"
KEEP_F32 = ("norm", "gate_inp", "exp_probs_b", "rope_", ".bias")  # small or derived tensors converters keep F32


def quantized_copy(name: str, qtype: str, directory) -> str:
    """tests/data/tiny/NAME.gguf with its matrices in `qtype` (a gguf-py quantizable type), written to
    directory/NAME.QTYPE.gguf once (again only if it is missing)."""
    dst = Path(directory) / f"{name}.{qtype}.gguf"
    if dst.exists():
        return str(dst)
    kind = gguf.GGMLQuantizationType[qtype]
    per = gguf.GGML_QUANT_SIZES[kind][0]

    def quantized(tensor: str, data: np.ndarray):
        if data.ndim >= 2 and data.shape[-1] % per == 0 and not any(k in tensor for k in KEEP_F32):
            return gguf.quants.quantize(data, kind), kind
        return None

    write_copy(TINY / f"{name}.gguf", dst, quantized)
    return str(dst)


def write_copy(src, dst, quantized) -> None:
    """GGUF `src` copied to `dst`, its metadata as it is and each tensor as quantized(name, data) gives it:
    (raw blocks, GGMLQuantizationType), or None to copy the tensor as f32."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        writer.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.array(t.data, dtype=np.float32)  # numpy shape
        q = quantized(t.name, data)
        if q is None:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, q[0], raw_shape=q[0].shape, raw_dtype=q[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
