"""llama.cpp's CPU arithmetic (numerics="llama.cpp"): ggml_ops.py holds the ops, and each
<architecture>.py a Forward with the same interface as the fast one (model.py), reading the weights
as the GGUF stores them and reproducing llama.cpp's logits bit for bit. Slow: for checking."""
