"""specx's engine, in six towers; arrows point one way (a tower imports only those left of it).

    draft.py ─► index/ ─► model/ ─► cost/ ─► decode/ ─► predict/ ─► serve/

- `draft.py`: the shared vocabulary, a draft token tree and where its tokens came from.
- `index/`: the suffix index (suffix arrays, sealed segments, live sequences, the compiled drafting
  kernel, its file format), what serving engines drive (`suffix_cache`, `engine_step`) and the
  successor table (`successors`).
- `model/`: the engine interface and its four engines (transformers with specx's CPU kernels,
  llama.cpp, `quantized/` on GGUF weights with numba kernels, `gpu/` in torch on a GPU), loading
  models and tokenizers, the KV and prefix caches, thread counts.
- `cost/`: what a pass costs (shipped and learned curves), what a draft node is worth, how much
  draft pays, the guard.
- `decode/`: the one decode loop (draft -> verify -> accept), drafters (the hybrid one included),
  verification and its verifiers, what a run shares, grammars, detokenization, `generate`.
- `predict/`: model-free replay, entropy, sampled prediction of a speedup, the replay and compare
  runs the `replay` command reports, and the engine trial.
- `serve/`: the serving worker thread, its events, its metrics, OpenAI tool calls.

`numba_cache.py` keys numba's kernel cache; the modules that define kernels call it. `kept.py`
reads the files kept between runs without trusting them. Importing a package here does no work
beyond importing its modules. Map and flow: docs/design.md.
"""
