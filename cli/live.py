"""`specx serve`'s live store and tenants, assembled: the scopes requests draft from
(core/serve/scopes.py), the thread that follows the store (store/watch.py), and the pace of a
shaped stream (cli/http/shaping.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core.cost.learned import LearnedCost
from .core.serve.pace import Pace

DEFAULT_PACE_S = 0.05  # a shaped stream's seconds per token until a pass cost is learned (or with --fixed-size)
PACE_MARGIN = 0.03  # a shaped stream's slots are a plain step's mean time apart and this share more
PACE_SPREADS = 3.0  # ... and the k-th after the first token this many spreads of a plain step x sqrt(k) further
LEARNED_PASSES = 16  # passes the cost must have seen (this run's or kept ones) before it sets the pace
# Draft nodes a step of a shaped server verifies at most, where its request is far enough ahead of
# its clock (core/serve/pace.py): a shaped stream's pace cannot gain from drafts (its slots are a
# plain step's), they save the server passes; more nodes need more slack and pay less.
SHAPED_DRAFT = 2


def live_store(stack: Any, db: Path, tenants: list[str], say: Callable[[str], None]) -> tuple[Any, Any]:
    """(scopes, watcher): each tenant's index built from the store (its rows and the public ones), or
    without tenants one scope over the stack's global index (every stored output); the watcher
    started from what they hold."""
    from .core.serve.scopes import Scopes
    from .store.db import Store
    from .store.tenants import PUBLIC, tenants_in
    from .store.watch import StoreWatcher, load_scopes

    with Store(db, readonly="auto") as store:
        held = tenants_in(store)
        if tenants:
            scopes, count, last = load_scopes(store, stack.fingerprint, tenants)
            for name in tenants:
                say(f"tenant {name}: drafts from {scopes.index(name).num_tokens:,} tokens (its own history and the "
                    f"public corpora)")
            idle = sorted(t or "(default)" for t, n in held.items() if n and t not in tenants and t != PUBLIC)
            if idle:
                say(f"the stored history of {', '.join(idle)} drafts no request (no --tenant names it)")
        else:
            scopes = Scopes({"": stack.global_index}, tenants=False)
            tokenizer_id = store.tokenizer_id(stack.fingerprint)
            state = store.index_state(tokenizer_id) if tokenizer_id is not None else None
            count, last = (state.num_calls, state.last_token_rowid) if state is not None else (
                store.token_rows(tokenizer_id) if tokenizer_id is not None else (0, 0))
            pooled = sorted(t for t in held if t)
            say("one tenant: every request drafts from every stored output" + (
                f" ({', '.join(pooled)} pooled: serve with --tenant NAME:KEY to keep them apart)" if pooled else ""))
    watcher = StoreWatcher(db, stack.fingerprint, scopes, count=count, last=last).start()
    say("the store is followed live: what is ingested or merged into it drafts within seconds")
    return scopes, watcher


def stream_pace(stack: Any, interval_ms: float | None, *, at_least_plain: bool = False) -> Callable[[Any], Pace]:
    """A shaped stream's clock for a request (core.serve.pace.Pace), from a plain step on a cache as
    long as the request can grow, rounded up to a power of two (core.cost.learned.plain_step): slots
    its mean time apart plus PACE_MARGIN, the k-th a further PACE_SPREADS of its spread x sqrt(k)
    out; `interval_ms`, if asked, instead of the mean. The bounds of steps verifying 0 to
    SHAPED_DRAFT draft nodes at a high quantile (core.cost.learned.step_bound), by which the request
    drafts only where it is ahead of its clock (so the gaps say nothing of the drafts:
    docs/security.md). DEFAULT_PACE_S a slot, and drafts by the cost alone, until the cost has seen
    LEARNED_PASSES passes: before, its level is the shipped curve's, not seconds. `at_least_plain`
    (tenants): never faster than the plain step, whatever `interval_ms` asks (a faster clock would
    let drafted stretches run on it and others lag, and the gaps tell them apart)."""
    cost = stack.cost
    bounded = isinstance(cost, LearnedCost) and (interval_ms is None or at_least_plain)
    if bounded:
        cost.ceiling = SHAPED_DRAFT

    def pace(req: Any) -> Pace:
        if not bounded or cost.passes < LEARNED_PASSES:
            return Pace(DEFAULT_PACE_S if interval_ms is None else interval_ms / 1000)
        # the context rounded up to a power of two: the pace tells a prompt's length no closer than that
        context = max(256, 1 << (len(req.prompt_ids) + req.settings.max_new_tokens - 1).bit_length())
        mean, spread = cost.plain_step(context)
        interval = mean * (1 + PACE_MARGIN)
        steps = tuple(cost.step_bound(1 + n, context) for n in range(SHAPED_DRAFT + 1))
        return Pace(interval if interval_ms is None else max(interval_ms / 1000, interval), PACE_SPREADS * spread, steps)

    return pace
