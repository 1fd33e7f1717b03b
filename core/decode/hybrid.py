"""The hybrid drafter: the suffix index where history reaches, the model's own successor table where
it does not (SuffixDecoding's hybrid mode, with Token Recycling's table in place of a draft model).

Each step the inner drafter (a SuffixDrafter) proposes its tree. When its score (expected accepted
tokens) is below `tau`, and always when it is empty, the successor table's tree after the
context's last token joins it: one tree holding both (the suffix nodes first, a node both propose
shared), tagged TABLE, which the decode loop then sizes on the cost curve like any draft, the
acceptance model having learnt the table's nodes as a source of their own. By default tau is
infinite (the table joins every step and the sizing alone decides what is verified): on an H200,
text-to-SQL 0-shot, that gave 5.37 tokens per step against 4.59 with tau = 1 and 4.56 for the
suffix tree alone (docs/design.md, "The successor table"). The table learns from
every verification pass (the verifier writes each row's top k into it), so it needs no second
model and no training.

>>> from specx.core.index.successors import SuccessorTable
>>> table = SuccessorTable(10, k=2)
>>> table.learn([3], [[4, 5]], [[0.9, 0.05]])
>>> drafter = HybridDrafter(None, table)
>>> drafter.start_request([1, 2, 3])
>>> drafter.speculate().token_ids
[4, 5]
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from ..draft import Draft
from ..index.successors import SuccessorTable
from .speculate import Drafter

TAU = math.inf  # the suffix tree's score below which the table's tree joins it (docs/design.md, "The successor table")
TABLE_NODES = 24  # the table's tree before sizing: what sizing on a flat curve still keeps (same section)
# On an engine that verifies linear drafts only its best path is verified: a smaller table tree holds
# it and costs less each step (llama.cpp, spider 0-shot, hybrid / suffix tokens/s: 0.96-1.01x with 6
# nodes against 0.92x and 1.00x with 24; 0.983x on average over ten runs of 6; docs/benchmarks.md,
# sessions 35 and 36)
LINEAR_TABLE_NODES = 6
# Grow the table's tree beneath the suffix tree's leaves too, not only after the context: no gain
# measured on the CPU (its tokens/s over the suffix drafter's: 0.95x against 0.99x for the root only on
# spider 0-shot, 1.01x against 1.01x on chat answers; docs/benchmarks.md, session 36), so off;
# `hybrid_bench --methods specx_hybrid_leaves` measures it
LEAVES = False


def table_nodes(tree_unsupported: str | None) -> int:
    """The table's tree size on an engine that verifies linear drafts only for the reason
    `tree_unsupported` (None: it verifies trees)."""
    return LINEAR_TABLE_NODES if tree_unsupported else TABLE_NODES


class HybridDrafter:
    """`inner` (None: the table alone) and `table`, as the module docstring says."""

    def __init__(self, inner: Drafter | None, table: SuccessorTable, *, tau: float = TAU,
                 max_nodes: int = TABLE_NODES, leaves: bool = LEAVES) -> None:
        self.inner, self.table, self.tau, self.max_nodes, self.leaves = inner, table, tau, max_nodes, leaves
        self.last = -1  # the context's last token: the table's tree grows after it

    @property
    def max_spec_tokens(self) -> int:
        """The most draft tokens a step proposes (a PredictionDrafter wrapping this one drafts as many)."""
        return max(getattr(self.inner, "max_spec_tokens", 0), self.max_nodes)

    def start_request(self, prompt: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.start_request(prompt)
        self.last = int(prompt[-1]) if len(prompt) else -1

    def extend(self, tokens: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.extend(tokens)
        if len(tokens):
            self.last = int(tokens[-1])

    def finish_request(self, learn: bool = True) -> None:
        if self.inner is not None:
            self.inner.finish_request(learn)

    def fork(self) -> HybridDrafter:
        """For one more concurrent request: the table shared, `inner` forked."""
        mine = copy.copy(self)
        mine.inner = self.inner.fork() if self.inner is not None else None
        return mine

    def speculate(self) -> Draft:
        draft = self.inner.speculate() if self.inner is not None else Draft()
        if len(draft) and draft.score >= self.tau:
            return draft
        seeds = [(-1, self.last, 1.0)]
        if self.leaves:  # where the suffix tree's paths end, the table goes on
            has_child = {p for p in draft.parents if p >= 0}
            seeds += [(i, tok, d) for i, (tok, d) in enumerate(zip(draft.token_ids, draft.probs)) if i not in has_child]
        return self.table.grow(draft, seeds, max_nodes=self.max_nodes)
