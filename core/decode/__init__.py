"""Decoding: the one loop every entrance uses, draft -> verify -> accept -> update.

Owns: the loop and its steps (`loop`), drafters (`speculate`), verification of draft trees and the
judge of a pass's logits (`verify`, `llama_verify`), what a pass costs and how much draft pays
(`cost`, `learned_cost`, `calibrate`, the shipped curves in `cost_curves/`), grammars (`grammar`),
tokens to text with stop strings (`text`), and `generate`, the loop with a model as verifier.

May import: core.draft, core.index, core.model.
"""
