"""Model loading (GGUF, HF directories), tokenizer and chat template, and architectures."""
