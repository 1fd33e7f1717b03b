"""Decoding: the one loop every entrance uses, draft -> verify -> accept -> update.

Owns: the loop and its steps (`loop`), drafters (`speculate`; the successor table joining the
suffix tree in `hybrid`), the judge of a pass's logits
(`verify`), the loop's verifiers (`verifiers/`: the model through its engine, a recorded output),
what a run shares between its requests (`stack`), what one request asks of a decoding
(`request`), grammars (`grammar`), tokens to text with stop strings (`text`), and `generate`,
the loop with a model as verifier. What a pass costs and how much
draft pays is core.cost's: the loop asks it through core.cost.forward.PassCost.

May import: core.draft, core.index, core.model, core.cost.
"""
