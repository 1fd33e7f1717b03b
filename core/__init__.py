"""specx's engine, in five towers; arrows point one way (a tower imports only those left of it).

    draft.py ─► index/ ─► model/ ─► decode/ ─► predict/ ─► serve/

- `draft.py`: the shared vocabulary, a draft token tree and where its tokens came from.
- `index/`: the suffix index (suffix arrays, sealed segments, live sequences, the compiled drafting
  kernel, its file format) and what serving engines drive (`suffix_cache`, `engine_step`).
- `model/`: loading models and tokenizers, the transformers CPU kernels, the KV and prefix caches,
  thread counts, llama.cpp.
- `decode/`: the one decode loop (draft -> verify -> accept), drafters, verification, cost and
  draft sizing, grammars, detokenization, `generate`.
- `predict/`: model-free replay, entropy, sampled prediction of a speedup, and the replay and
  compare runs the `replay` command reports.
- `serve/`: the serving worker thread, its metrics, OpenAI tool calls.

`numba_cache.py` keys numba's kernel cache; the modules that define kernels call it. Importing a
package here does no work beyond importing its modules. Map and flow: docs/design.md.
"""
