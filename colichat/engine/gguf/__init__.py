"""GGUF files in and out."""
