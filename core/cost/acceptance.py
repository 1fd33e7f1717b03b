"""The acceptance model: the chance that the verifier accepts a draft node, learned from its verdicts.

It lives in the cost tower because it is the other half of what a draft is worth: sizing
(core.cost.sizing.size_draft) weighs each node's chance of acceptance against what the pass over
it costs. It reads only the draft (core.draft: a node's sources, match length, depth and share)
and the verdicts it is given, and every tower that decodes (decode's loop, predict's replays,
serve's worker) passes one to the loop: the lowest tower they all may import.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..draft import GLOBAL, GRAMMAR, MODEL, REQUEST, TABLE, Draft

PRIOR = 2.0  # the drafter's share counts as this many verdicts of a cell
WINDOW = 1000  # a cell's counts are halved when its tries reach this
SOURCE_CELLS = 10  # _source_cell's rows: the index bits and the model's guess (0-7), a grammar's token (8),
GRAMMAR_CELL, TABLE_CELL = 8, 9  # the successor table's node (9)
LENGTH_CELLS = 6  # _bucket's classes of match length and of depth: 1, 2, 3-4, 5-8, 9-16, 17+
SHARE_EDGES = (0.99, 0.5, 0.25)  # a node's share of its parent's continuations, bucketed at these


class AcceptanceModel:
    """The chance that the verifier accepts a draft node, learned from the verifier's verdicts.

    A suffix index scores node i by D(i) = D(parent) x share(i), share being the fraction of the
    parent's continuations that went on with node i's token. Counts from a few occurrences
    overstate that, and how much depends on the node: a node grown from a 1-token match or deep in
    a chain is worth much less than its counts say; one grown from a 20-token match, or proposed
    by the request's own index (prompt + output so far) rather than by other requests' outputs,
    about as much; a root the model itself guessed (draft.MODEL) is worth what its own verdicts
    show. So each node falls in a cell (its sources, match length, depth and share, each
    bucketed) and its chance of being accepted once its parent was is estimated per cell:

        h(cell) = (accepted + prior x share) / (tried + prior)

    counted over every node the verifier reached (a root, or a child of an accepted node). A
    node's estimate is the product of h along its path, so a child never beats its parent.
    Counts are halved when a cell reaches `window` tries, to follow a workload that changes.

    >>> model = AcceptanceModel()
    >>> chain = Draft([7, 8], [-1, 0], [1.0, 1.0], 2.0, 1)
    >>> for _ in range(50):
    ...     model.update(chain, [0])  # the first node is always accepted, the second never
    >>> [round(p, 2) for p in model.estimates(chain)]
    [1.0, 0.04]
    """

    def __init__(self, prior: float = PRIOR, window: int = WINDOW) -> None:
        self.prior = float(prior)
        self.window = int(window)
        self.tried = np.zeros((SOURCE_CELLS, LENGTH_CELLS, LENGTH_CELLS, len(SHARE_EDGES) + 1))
        self.accepted = np.zeros_like(self.tried)

    def _cells(self, draft: Draft) -> tuple[list[tuple[int, int, int, int]], list[float]]:
        n = len(draft.token_ids)
        probs = draft.probs if len(draft.probs) == n else [1.0] * n
        sources, lens = draft.node_tags()
        depths = draft.depths()
        cells, shares = [], []
        for i, par in enumerate(draft.parents):
            above = probs[par] if par >= 0 else 1.0
            share = min(max(probs[i] / above, 0.0), 1.0) if above > 0 else 0.0
            share_bucket = next((k for k, edge in enumerate(SHARE_EDGES) if share >= edge), len(SHARE_EDGES))
            cells.append((_source_cell(sources[i]), _bucket(lens[i]), _bucket(depths[i]), share_bucket))
            shares.append(share)
        return cells, shares

    def estimates(self, draft: Draft) -> list[float]:
        """Each node's estimated chance of being accepted (non-increasing along every path)."""
        cells, shares = self._cells(draft)
        out: list[float] = []
        for i, (cell, share, par) in enumerate(zip(cells, shares, draft.parents)):
            h = (self.accepted[cell] + self.prior * share) / (self.tried[cell] + self.prior)
            out.append(float(h) * (out[par] if par >= 0 else 1.0))
        return out

    def update(self, draft: Draft, accepted_nodes: Sequence[int]) -> None:
        """Learn from one verdict: `accepted_nodes` are the draft's accepted path (root first)."""
        cells, _ = self._cells(draft)
        on_path = set(accepted_nodes)
        for i, par in enumerate(draft.parents):
            if par < 0 or par in on_path:  # the verifier reached this node
                cell = cells[i]
                self.tried[cell] += 1
                self.accepted[cell] += i in on_path
                if self.tried[cell] >= self.window:
                    self.tried[cell] /= 2
                    self.accepted[cell] /= 2


def _bucket(n: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, 17+ -> 0..5."""
    return min((max(int(n), 1) - 1).bit_length(), LENGTH_CELLS - 1)


def _source_cell(sources: int) -> int:
    """The acceptance model's row for a node's sources: the index bits and the model's guess
    (REQUEST, GLOBAL, MODEL) as they are, else 8 for a grammar's forced token, else 9 for the successor
    table's node, else 0 (a prediction)."""
    return sources & (REQUEST | GLOBAL | MODEL) or (
        GRAMMAR_CELL if sources & GRAMMAR else TABLE_CELL if sources & TABLE else 0)
