"""GGUF files in and out: the header walker (header.py), the one-pass reader (file.py), a model file's
metadata and tensors (tensors.py), the numpy dequantizers (dequant.py), and the dequantized weights
kept between runs (prepared.py). Knows nothing of architectures: a ModelConfig is made in
architectures/ (load_config).
"""
