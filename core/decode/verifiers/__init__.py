"""The decode loop's verifiers (core.decode.loop.Verifier), one module per kind.

- `model`: ModelVerifier, a model through its engine (core.model.engine.Engine: transformers or
  llama.cpp): one pass per draft, judged by core.decode.verify.judge.
- `recorded`: RecordedVerifier, a recorded output taken as what the model writes (model-free
  replay, core.predict.replay).
"""
