"""Prediction and replay: what speculation would do on recorded outputs, without or with a model.

Owns: model-free replay (`replay`), the empirical entropy of a workload (`entropy`), sampled
replay and the speedup it predicts (`estimate`, with the statistics in `sampling`), and the
method runs `specx replay` reports: replay with each drafting method, ArcticInference's as a
baseline when installed, and model replays that compare decoding methods token for token.

May import: core.draft, core.index, core.model, core.decode.
"""
