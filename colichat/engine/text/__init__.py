"""Text <-> token ids: the tokenizers a GGUF names (load.py picks BPE, tokenizer.py, or SentencePiece,
spm.py), llama.cpp's pre-tokenizer regexes (pretokenizer.py) and the model's chat template
(template.py). Knows nothing of the forward pass.
"""
