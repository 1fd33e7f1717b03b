"""One batched request's view of the stack it decodes with (`request_stack`), so that the decode
loop runs in the batch as it runs alone: an engine and its sessions whose passes go through the
Batcher (core/serve/batch.py) instead of to the model (`BatchedEngine`, `BatchedSession`: a new
prompt's prefill waits for one in flight that fills the same prefix cache with the same start), a
cost that sizes its drafts against the rest of the shared pass and hears from each pass what it
was (`BatchCost`), and a drafter of its own over the shared index (`fork_drafter`). The engine
chooses the threads of the passes the batcher runs (core.model.sessions.SessionEngine.forward_batch).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from ..cost.guard import DraftGuard, tighter
from ..decode.stack import Stack
from ..draft import Draft
from ..model.sessions import run_steps
from .batch import Batcher, Member


class BatchedEngine:
    """One request's view of an engine (core.model.sessions.SessionEngine) whose passes go through a
    Batcher (core.model.engine.Engine as the decode loop uses it; `hit_tokens` counts this request's
    cached prompt tokens)."""

    SHARED = frozenset({"name", "vocab_size", "context_length", "precision", "kernels", "tree_unsupported", "device",
                        "prompt_lookup", "cost_curve", "tuner"})  # the engine's own, read through

    def __init__(self, engine: Any, batcher: Batcher, member: Member) -> None:
        self.engine, self.batcher, self.member = engine, batcher, member
        self.hit_tokens, self.batches = 0, False  # batches: its passes are already the batcher's

    def __getattr__(self, name: str) -> Any:
        if name in BatchedEngine.SHARED:
            return getattr(self.engine, name)
        raise AttributeError(f"{type(self).__name__} has no {name!r}")

    def start(self, tokens: Sequence[int], prefix_cache: Any = None) -> BatchedSession:
        tokens = [int(t) for t in tokens]
        batcher, member = self.batcher, self.member
        # the cache this prefill reads and, when the prompt fits its budget, stores into
        usable = prefix_cache is not None and getattr(prefix_cache, "max_tokens", 0) >= len(tokens)
        while usable and (leader := batcher.leader(tokens, prefix_cache.longest_prefix(tokens)[0],
                                                   prefix_cache)) is not None:
            batcher.park(member, leader)
        done = threading.Event()
        batcher.prefilling[member] = (tokens, prefix_cache if usable else None, done)
        try:
            session = run_steps(self.engine.start_steps(tokens, prefix_cache),
                                lambda part: batcher.run(member, part, prefill=True))
        finally:
            del batcher.prefilling[member]
            done.set()
        self.hit_tokens += session.reused
        return BatchedSession(session, self.batcher, self.member)


class BatchedSession:
    """A session (core.model.sessions.Session) whose passes go through the Batcher."""

    def __init__(self, session: Any, batcher: Batcher, member: Member) -> None:
        self.session, self.batcher, self.member = session, batcher, member

    def score(self, pending: list[int], draft: Draft) -> Any:
        import torch

        return torch.from_numpy(self.batcher.run(self.member, self.session.pass_for(pending, draft)))

    def keep_path(self, accepted_nodes: list[int]) -> None:
        self.session.keep_path(accepted_nodes)


class BatchCost:
    """The shared PassCost (core.cost.forward) as one request in the batch sees it: its drafts are
    sized against the rest of the pass (`others`), and the passes teach the cost what they are: a
    pass the request had alone is a step of its own (curve and guard, as when serving one at a
    time), a shared pass teaches the curve its shape once (`observe_pass`). While others share the
    passes no plain anchor is asked for (a shared pass has more than one row whatever its drafts)."""

    def __init__(self, base: Any, batcher: Batcher, member: Member, guard: DraftGuard | None = None) -> None:
        self.base, self.batcher, self.member = base, batcher, member
        self.guard = guard  # judges this request's rows of shared passes (a tenant's); None: the batcher's

    def __call__(self, n: int, context: int | None = None) -> float:
        line = self.batcher.line() if len(self.batcher.members) > 1 else None
        return self.base(n, context) if line is None else line[0] + line[1] * n

    def shape(self, n: int, context: int | None = None) -> float:
        return self.base.shape(n, context)

    def others(self) -> tuple[int, float]:
        return self.batcher.others(self.member)

    def max_draft(self) -> int | None:
        if len(self.batcher.members) <= 1:
            return self.base.max_draft()
        return tighter((self.guard or self.batcher.guard).max_draft(), getattr(self.base, "ceiling", None))

    def observe_step(self, *, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
                     num_out: int, tag: Any = None) -> None:
        member, last = self.member, self.member.last
        member.tokens = float(num_out)
        if last is None:
            return
        last.tokens += num_out
        last.drafted += num_tokens - 1
        if last.requests == 1:  # alone: its step is what a step of one request is (the wait aside)
            self.base.observe_step(num_tokens=num_tokens, context=context, verify_seconds=last.seconds,
                                   step_seconds=max(step_seconds - verify_seconds, 0.0) + last.seconds,
                                   num_out=num_out, tag=last.tag)
        else:
            if not last.observed:
                last.observed = True
                self.base.observe_pass(last.rows, last.context, last.seconds, last.tag)
            if self.guard is not None:
                self._judge_own(num_tokens, num_out, last.requests)

    def _judge_own(self, num_tokens: int, num_out: int, requests: int) -> None:
        """Show this request's guard its rows of a shared pass: their share of the pass (its fixed
        part split among the requests, a row's part per row, by the line fitted to the shared
        passes: the machine's cost) against plain decoding's one row per token. The other requests'
        drafts do not enter it, so one tenant's losing drafts never cap another's."""
        line = self.batcher.line()
        if line is None:
            return
        if num_tokens <= 1:
            self.guard.observe_plain()
            return
        share = line[0] / max(requests, 1)
        self.guard.observe_priced(share + line[1] * num_tokens, share + line[1], num_out, num_tokens - 1)


def fork_drafter(drafter: Any) -> Any:
    """A drafter for one more concurrent request (its `fork()`: core.decode.speculate.Drafter), or None."""
    return None if drafter is None else drafter.fork()


def request_stack(stack: Stack, batcher: Batcher, member: Member, guard: DraftGuard | None = None) -> Stack:
    """The stack one batched request decodes with (its engine, drafter and cost views). `guard`: judges its drafts in shared passes (None: the batcher's)."""
    cost = BatchCost(stack.cost, batcher, member, guard) if stack.cost is not None else None
    return dataclasses.replace(stack, engine=BatchedEngine(stack.engine, batcher, member),
                               drafter=fork_drafter(stack.drafter), cost=cost)
