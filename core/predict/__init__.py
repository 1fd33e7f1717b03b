"""Prediction and replay: what speculation would do on recorded outputs, without or with a model.

Owns: model-free replay (`replay`), the empirical entropy of a workload (`entropy`), sampled replay
and the speedup it predicts (`estimate`, on the cost curves of `curves`, with the statistics in
`sampling`), the method runs `specx replay` reports (`methods`: replay with each drafting method,
ArcticInference's as a baseline when installed), model replays that compare decoding methods token
for token (`compare`), and the engine trial that picks the engine a model runs on (`engines`).

May import: core.draft, core.index, core.model, core.decode.
"""
