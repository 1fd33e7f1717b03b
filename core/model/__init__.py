"""The model: loading it and making its passes fast; nothing about drafts.

Owns: loading models and tokenizers, the built-in one included (`load`); transformers on the CPU
with specx's small-batch kernels (`kernels`, `matmul`, `attention`), the KV cache and the prefix
cache of recent prompts (`kv_cache`, `prefix_cache`); each pass's thread count (`threads`);
GGUF models on llama.cpp (`llamacpp`, and `on_llamacpp`, the one check of which engine runs).

May import: torch, transformers, llama-cpp-python (when installed), numba (through
core.numba_cache). Not the index, decoding or anything above.
"""
