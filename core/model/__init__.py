"""The model: loading it and making its passes fast (a pass scores a given draft; which draft and
which tokens to accept are decoding's).

Owns: the engine interface (`engine`: what decoding asks of a model, whatever runs it; no module
outside this tower asks which engine it has); loading models and tokenizers, the built-in one
included (`load`); chat messages as the model reads them (`chat`: the chat template, a
conversation's token ids, a logged prompt's text); the prefix cache of recent prompts (`prefix_cache`: the generic part, each
engine's own kind in its wing); each pass's thread count (`threads`); GGUF models on llama.cpp as
an engine (`llamacpp`), the machine's instruction sets and llama.cpp's build flags (`cpu`), and an
engine proven in a child process before it runs in this one (`probe`); the sessions over a model
with `forward_batch` (`sessions`), which specx's own engines build on. Each of specx's engines is a
wing of its own: transformers (`transformers/`: the engine, its tree passes, KV cache, prefix cache
and small-batch kernels), the quantized engine (`quantized/`) and the GPU engine (`gpu/`).

May import: torch, transformers, llama-cpp-python (when installed), numba (through
core.numba_cache). Not the index, decoding or anything above.
"""
