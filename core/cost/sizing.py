"""How much draft a step pays for: the draft cut where the expected tokens per second peak.

Keep the draft's most likely nodes only while the expected tokens per second of the step improves:

    rate(k) = (1 + sum of the k largest P) / seconds(pending + k)

(each step emits its accepted tokens plus one), P being each node's chance of acceptance as an
AcceptanceModel (core.cost.acceptance) learns it from the verdicts, or the drafter's D. A child's
P never exceeds its parent's, so taking nodes by P keeps the kept set a tree.

When other requests share the pass (the batched server: core.serve.batch), their rows R and the
tokens T they emit are part of it, and the rate is the whole pass's:

    rate(k) = (T + 1 + sum of the k largest P) / seconds(R + pending + k)

A node is then kept while its P beats the pass's tokens per second times the time it adds: every
request sizing its tree so fills the pass with the nodes of all trees in order of expected tokens
per unit of cost, and under heavy load (a high rate) the pass goes to plain rows.
"""

from __future__ import annotations

from collections.abc import Callable

from ..draft import Draft, subtree
from .acceptance import AcceptanceModel


def size_draft(draft: Draft, cost: Callable[..., float], num_pending: int = 1, *,
               acceptance: AcceptanceModel | None = None, context: int | None = None,
               max_nodes: int | None = None, others: tuple[int, float] = (0, 0.0)) -> Draft:
    """The draft cut to the size that maximises expected tokens per second of the step.

    Nodes are worth their chance of being accepted: `acceptance.estimates` (what verification has
    shown drafts like this one to be worth), else the drafter's own D. `context` is the number of
    tokens in the cache (a longer one makes each verified token dearer). `max_nodes` caps the
    size whatever pays (core.cost.guard's cap). `others`: (rows, tokens) of the other requests in
    the pass (the module docstring).
    """
    n = len(draft)
    if n == 0:
        return draft
    probs = acceptance.estimates(draft) if acceptance is not None else list(draft.probs) or [1.0] * n
    order = sorted(range(n), key=lambda i: (-probs[i], i))
    chosen: set[int] = set()
    taken: list[int] = []
    rows = num_pending + others[0]
    expected = 1.0 + others[1]
    best_k, best_rate = 0, expected / cost(rows, context)
    for i in order[: n if max_nodes is None else max_nodes]:
        if draft.parents[i] >= 0 and draft.parents[i] not in chosen:
            continue  # a child more likely than its parent (not from suffix drafts): keep it a tree
        chosen.add(i)
        taken.append(i)
        expected += probs[i]
        rate = expected / cost(rows + len(taken), context)
        if rate > best_rate:
            best_k, best_rate = len(taken), rate
    keep = [False] * n
    for i in taken[:best_k]:
        keep[i] = True
    return subtree(draft, keep)
