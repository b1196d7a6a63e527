"""colichat: terminal chat for MLA GGUF models on numpy, with the KV cache kept on disk."""

__version__ = "0.1.0"
