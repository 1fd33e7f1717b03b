"""Decoding: the one loop every entrance uses, draft -> verify -> accept -> update.

Owns: the loop and its steps (`loop`), drafters (`speculate`), verification of draft trees and the
judge of a pass's logits (`verify`, `llama_verify`), grammars (`grammar`), tokens to text with
stop strings (`text`), and `generate`, the loop with a model as verifier. What a pass costs and how
much draft pays is core.cost's: the loop asks it through core.cost.forward.PassCost.

May import: core.draft, core.index, core.model, core.cost.
"""
