"""What a forward pass costs, and how much draft that pays for.

On a CPU the time of one verification pass grows quickly with the number of tokens verified; on
a GPU it is nearly flat for small trees. So the right draft size depends on the hardware: a curve
seconds(n) (learned from the passes themselves, core.decode.learned_cost; `calibrate` times one on
demand, for `specx bench cost`), then keep the draft's most likely nodes only while the expected
tokens per second of the step improves (`size_draft`):

    rate(k) = (1 + sum of the k largest P) / seconds(pending + k)

(each step emits its accepted tokens plus one), P being each node's chance of acceptance as an
AcceptanceModel learns it from the verdicts (or the drafter's D). A child's P never exceeds its
parent's, so taking nodes by P keeps the kept set a tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..draft import GRAMMAR, Draft


@dataclass(frozen=True)
class ForwardCost:
    """Measured seconds of one verification pass over n tokens on a cache of `context` tokens
    (linear in between and beyond); with a second curve at `long_context`, linear in the cache
    length too (attention reads the whole cache for every token verified)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = 128
    long_seconds: tuple[float, ...] | None = None
    long_context: int = 0

    def __call__(self, n: int, context: int | None = None) -> float:
        short = _curve(self.sizes, self.seconds, n)
        if self.long_seconds is None or context is None or self.long_context <= self.context:
            return short
        w = (context - self.context) / (self.long_context - self.context)
        return max(short + w * (_curve(self.sizes, self.long_seconds, n) - short), 0.25 * short)


def _curve(sizes: Sequence[int], seconds: Sequence[float], n: int) -> float:
    xs, ys = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if n <= xs[-1] or len(xs) < 2:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (n - xs[-1]))


def _bucket(n: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, 17+ -> 0..5."""
    return min((max(int(n), 1) - 1).bit_length(), 5)


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

    def __init__(self, prior: float = 2.0, window: int = 1000) -> None:
        self.prior = float(prior)
        self.window = int(window)
        self.tried = np.zeros((9, 6, 6, 4))  # sources (_source_cell), match length, depth, share
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
            share_bucket = 0 if share >= 0.99 else 1 if share >= 0.5 else 2 if share >= 0.25 else 3
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


def _source_cell(sources: int) -> int:
    """The acceptance model's row for a node's sources: the index bits and the model's guess
    (REQUEST, GLOBAL, MODEL) as they are, else 8 for a grammar's forced token, else 0 (a prediction)."""
    return sources & 7 or (8 if sources & GRAMMAR else 0)


def subtree(draft: Draft, keep: Sequence[bool]) -> Draft:
    """The draft's nodes where `keep` is true (their parents must be kept too), re-indexed, order kept.

    >>> subtree(Draft([5, 6, 7], [-1, 0, -1], [0.5, 0.25, 0.2], 0.95, 2), [True, False, True]).token_ids
    [5, 7]
    """
    new_index: dict[int, int] = {}
    tokens, parents = [], []
    for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents)):
        if keep[i] and (par < 0 or par in new_index):
            new_index[i] = len(tokens)
            tokens.append(tok)
            parents.append(-1 if par < 0 else new_index[par])
    kept = list(new_index)
    pick = lambda values: [values[i] for i in kept] if values else []  # noqa: E731
    probs = pick(draft.probs)
    return Draft(tokens, parents, probs, float(sum(probs)), draft.match_len, pick(draft.sources),
                 pick(draft.match_lens))


def size_draft(draft: Draft, cost: Callable[..., float], num_pending: int = 1,
               acceptance: AcceptanceModel | None = None, context: int | None = None,
               max_nodes: int | None = None) -> Draft:
    """The draft cut to the size that maximises expected tokens per second of the step.

    Nodes are worth their chance of being accepted: `acceptance.estimates` (what verification has
    shown drafts like this one to be worth), else the drafter's own D. `context` is the number of
    tokens in the cache (a longer one makes each verified token dearer). `max_nodes` caps the
    size whatever pays (core.decode.learned_cost's guard).
    """
    n = len(draft)
    if n == 0:
        return draft
    probs = acceptance.estimates(draft) if acceptance is not None else list(draft.probs) or [1.0] * n
    order = sorted(range(n), key=lambda i: (-probs[i], i))
    chosen: set[int] = set()
    taken: list[int] = []
    best_k, best_rate, expected = 0, 1.0 / cost(num_pending, context), 1.0
    for i in order[: n if max_nodes is None else max_nodes]:
        if draft.parents[i] >= 0 and draft.parents[i] not in chosen:
            continue  # a child more likely than its parent (not from suffix drafts): keep it a tree
        chosen.add(i)
        taken.append(i)
        expected += probs[i]
        rate = expected / cost(num_pending + len(taken), context)
        if rate > best_rate:
            best_k, best_rate = len(taken), rate
    keep = [False] * n
    for i in taken[:best_k]:
        keep[i] = True
    return subtree(draft, keep)


# ------------------------------------------------------------------------------- a curve to trust

CURVE_TOLERANCE = 0.25  # timing noise a measured curve may show above k one-token passes
CHEAPER_LIMIT = 0.5  # a longer pass may cost this share of a shorter one, no less (kernels differ by size)


def check_curve(cost: ForwardCost, tolerance: float = CURVE_TOLERANCE, cheaper: float = CHEAPER_LIMIT) -> str | None:
    """Why a measured curve cannot be right, or None. A pass over k tokens shares the weights'
    reads among them: it cannot cost much more than k one-token passes (`tolerance`). It does the
    work of a shorter pass and more: it cannot cost much less than one (`cheaper`; some less is
    real: a matrix-vector kernel can be slower than the small-matrix one). A busy machine breaks
    them (seen: 1 token 736 ms, 3 tokens 6.6 s).

    >>> check_curve(ForwardCost((1, 2, 4), (0.030, 0.032, 0.035))) is None
    True
    >>> check_curve(ForwardCost((1, 3), (0.736, 6.6)))
    '3 tokens cost 9.0x one token (at most 3.8x is possible)'
    >>> check_curve(ForwardCost((1, 2, 4), (0.030, 0.070, 0.031)))
    '4 tokens cost 0.44x what 2 tokens cost (a longer pass cannot be that much cheaper)'
    """
    for curve in (c for c in (cost.seconds, cost.long_seconds) if c):
        base = curve[0] if cost.sizes[0] == 1 else None
        most, most_at = 0.0, 0
        for n, seconds in zip(cost.sizes, curve):
            if not (seconds > 0 and np.isfinite(seconds)):
                return f"{n} tokens cost {seconds} s"
            if seconds < cheaper * most:
                return (f"{n} tokens cost {seconds / most:.2f}x what {most_at} tokens cost "
                        f"(a longer pass cannot be that much cheaper)")
            if base is not None and seconds > (1 + tolerance) * n * base:
                return f"{n} tokens cost {seconds / base:.1f}x one token (at most {(1 + tolerance) * n:.1f}x is possible)"
            if seconds > most:
                most, most_at = seconds, n
    return None
