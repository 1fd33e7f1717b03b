"""Continuous batching for `specx serve`: the running requests share each forward pass.

Each running request decodes on a thread of its own, with the decode loop every entrance uses
(core.decode.generate), over a view of the stack made for it (core/serve/request_view.py): its
engine hands every pass it needs (the prompt's prefill chunks, then one verification tree per step)
to the `Batcher` and waits. The worker thread, which owns the model, runs one forward pass as soon
as every running request waits (the engine's forward_batch: a ragged batch, each part its own KV
cache and tree mask, on the threads the engine chooses) and hands each its logits. Requests join
and leave between passes; a new one's prefill runs a chunk (core.model.sessions.PREFILL_CHUNK
tokens) per pass beside the others' trees, so it never stalls them for more than a pass.

Lossless per request: the engine's kernels are batch-invariant and attention never mixes
sequences, so a request's logits are the bits its own pass gives; its sampler, grammar, stops and
drafter are its own. Its output is what it is when it runs alone.

The request threads' Python runs one at a time: a thread holds the batcher's `baton` except while
its pass is waited for. The state the requests share (the global index, the successor table, the
acceptance model and the learned cost, each tenant's own with tenants, the prefix cache) so sees
one thread at a time, as before.

One draft budget for the pass: each request sizes its tree against the rows and tokens the others
put in the pass (request_view.BatchCost.others, core.cost.sizing.size_draft), so a node is
verified while its chance beats the pass's tokens per second times the time it adds: a confident
tree takes more of the pass than a doubtful one, and under heavy load the pass goes to plain rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..cost.guard import DraftGuard
from ..model.prefix_cache import free_memory
from ..model.sessions import pass_size
from ..model.threads import last_threads

MAX_BATCH = 16  # the default cap on requests decoded together (--max-batch): past it, on CPUs, passes grow in step
PASS_WAIT_S = 0.25  # the worker's longest wait for a pass's parts before it looks at its queue again
FIT_DECAY = 0.97  # the weight of a pass in the batch's cost line falls by this factor each later pass
FIT_PASSES = 8  # passes before the line is used (the shared cost's curve until then)
MIN_SHARED = 64  # prompt tokens a prefill in flight must share beyond the prefix cache for a new one to wait for it


class Pass:
    """One forward pass the batcher ran: its rows, requests, seconds, thread tag, mean context."""

    __slots__ = ("rows", "requests", "seconds", "tag", "context", "observed", "prefill", "steps", "tokens",
                 "drafted")

    def __init__(self, rows: int, requests: int, seconds: float, tag: Any, context: int, prefill: int,
                 steps: int) -> None:
        self.rows, self.requests, self.seconds, self.tag, self.context = rows, requests, seconds, tag, context
        self.prefill = prefill  # rows of prompts' prefill chunks
        self.steps = steps  # requests' decode steps in it (the other parts: prefill chunks)
        self.observed = False  # a shared pass teaches the cost once
        self.tokens = 0  # the steps' output tokens, as the requests report them (request_view.BatchCost.observe_step)
        self.drafted = 0  # ... and their draft nodes


class Member:
    """A running request as the batcher sees it: its part of the pass it waits for, and what it
    put in its last pass (rows, tokens out: what the others size their drafts against)."""

    def __init__(self) -> None:
        self.part: tuple[Any, ...] | None = None
        self.prefill = False  # the part is a prefill chunk (not a step)
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.rows = 1  # rows of its last pass
        self.tokens = 1.0  # tokens its last step emitted
        self.last: Pass | None = None  # the last pass it was in
        self.parked = False  # waiting for another request's prefill (request_view.BatchedEngine.start)


class Batcher:
    """The rendezvous between the request threads and the thread that owns the model (`engine`: a
    core.model.sessions.SessionEngine, whose forward_batch runs a pass and whose `tuner` says on how
    many threads it ran)."""

    def __init__(self, engine: Any, *, say: Callable[[str], None] = lambda message: None) -> None:
        self.engine = engine
        self.cond = threading.Condition()
        self.baton = threading.Lock()
        self.members: list[Member] = []
        # prompts being prefilled: each with the prefix cache it fills (None: it stores nowhere) and its end
        self.prefilling: dict[Member, tuple[list[int], Any, threading.Event]] = {}
        self.passes = 0
        self.rows = 0  # rows of every pass, added up (tokens per pass: rows / passes)
        self.prefill_rows = 0
        self.seconds = 0.0  # the passes' time, added up
        self.guard = DraftGuard(lambda n, context: 1.0, say)  # whether drafts pay in the shared passes
        self._last: Pass | None = None
        self._fit = np.zeros(5)  # decayed sums of 1, rows, seconds, rows^2, rows * seconds over the shared passes

    # ---------------------------------------------------------------- request threads

    def join(self) -> Member:
        """A request begins (called on the worker thread, so that it is in the next pass)."""
        member = Member()
        with self.cond:
            self.members.append(member)
        return member

    def leave(self, member: Member) -> None:
        """A request ends (its thread, holding the baton)."""
        with self.cond:
            self.members.remove(member)
            self.cond.notify_all()

    def run(self, member: Member, part: tuple[Any, ...], prefill: bool = False) -> Any:
        """Put `part` (the model's forward_batch's; `prefill`: a prompt's chunk) in the next pass and
        wait for its logits; called with the baton held, which is given up while waiting."""
        member.part, member.prefill, member.result, member.error = part, prefill, None, None
        member.done.clear()
        with self.cond:
            self.cond.notify_all()
        self.baton.release()
        try:
            member.done.wait()
        finally:
            self.baton.acquire()
        if member.error is not None:
            raise member.error
        return member.result

    def others(self, member: Member) -> tuple[int, float]:
        """(rows, tokens) the other running requests put in their last passes."""
        rows, tokens = 0, 0.0
        for m in self.members:
            if m is not member and not m.parked:
                rows += m.rows
                tokens += m.tokens
        return rows, tokens

    # ---------------------------------------------------------------- the worker thread

    def ready(self, wake: Any = lambda: False, timeout: float = PASS_WAIT_S) -> list[Member]:
        """Wait until every running request waits for a pass (their members, in the order they
        joined) or `wake()` says there is other work; [] then, or after `timeout`."""
        def due() -> bool:
            waiting = [m for m in self.members if not m.parked]
            return bool(waiting) and all(m.part is not None for m in waiting)

        with self.cond:
            self.cond.wait_for(lambda: due() or wake(), timeout)
            return [m for m in self.members if m.part is not None] if due() else []

    def _judge(self, done: Pass | None) -> None:
        """Show the guard a shared pass whose requests have all reported their steps (the next pass
        is due, so each has): its time per output token against plain decoding's in passes of the
        same requests (one row each, beside the same prefill), as the line prices them."""
        line = self.line()
        if done is None or line is None or done.requests < 2 or not done.steps:
            return
        if not done.drafted:
            self.guard.observe_plain()
            return
        plain = (line[0] + line[1] * (done.prefill + done.steps)) / done.steps
        self.guard.observe_priced(done.seconds, plain, done.tokens, done.drafted / done.steps)

    def line(self) -> tuple[float, float] | None:
        """(seconds per pass, seconds per row) of the shared passes, fitted to the last ones (each
        weighing FIT_DECAY times the next); None before FIT_PASSES or without a spread of sizes.
        A batch's rows come from several sequences and reach sizes one request's passes never
        do: the shared cost's curve is learned on those (and flat past them), this line on these."""
        n, x, y, xx, xy = self._fit
        if self.passes < FIT_PASSES or n <= 0:
            return None
        var = xx / n - (x / n) ** 2
        if var <= 1.0:
            return None
        slope = (xy / n - x / n * y / n) / var
        base = y / n - slope * x / n
        return (base, slope) if slope > 0 and base > 0 else None

    def park(self, member: Member, until: threading.Event) -> None:
        """Sit out the passes until `until` is set (the baton given up meanwhile)."""
        member.parked = True
        with self.cond:
            self.cond.notify_all()
        self.baton.release()
        try:
            until.wait()
        finally:
            self.baton.acquire()
            member.parked = False

    def leader(self, tokens: list[int], cached: int, prefix_cache: Any) -> threading.Event | None:
        """The prefill in flight that fills `prefix_cache` (the one this request reads) and whose
        prompt shares with `tokens` more than `cached` tokens (what that cache holds of them now)
        by a chunk or more: waiting for it to be stored saves prefilling the shared part twice
        (agents fanning out with one system prompt). A prefill that fills another cache (another
        tenant's, core/serve/scopes.tenant_prefix_caches) or none is never waited for: the request
        could not read what it stores, so it would only wait, and how long it waited would tell
        its client that someone else's prompt in flight starts like its own."""
        best, event = cached + MIN_SHARED, None
        for prompt, fills, done in self.prefilling.values():
            if fills is None or fills is not prefix_cache:
                continue
            n = min(len(prompt), len(tokens))
            shared = next((i for i in range(n) if prompt[i] != tokens[i]), n)
            if shared >= best:
                best, event = shared, done
        return event

    def step(self, members: Sequence[Member]) -> None:
        """One forward pass over the parts of `members` (from `ready`); each gets its logits or the
        error the pass raised."""
        self._judge(self._last)
        parts = [m.part for m in members]
        rows, context = pass_size(parts)
        prefill = sum(len(m.part[1]) for m in members if m.prefill)
        steps = sum(not m.prefill for m in members)
        started = time.perf_counter()
        results: list[Any] = [None] * len(parts)
        errors: list[BaseException | None] = [None] * len(parts)
        try:
            results = self.engine.forward_batch(parts)
            error = None
        except Exception as exc:  # noqa: BLE001 - the requests answer it; the worker goes on
            error = errors[0] = exc
            for i, part in enumerate(parts if len(parts) > 1 else ()):  # which failed: each alone (a cache's
                try:  # length moves only when its pass ends), so that one request's fault stays its own
                    results[i] = self.engine.forward_batch([part])[0]
                    errors[i] = None
                except Exception as alone:  # noqa: BLE001
                    errors[i] = alone
        seconds = time.perf_counter() - started
        done = Pass(rows, len(parts), seconds, last_threads(self.engine.tuner), context, prefill, steps)
        self._last = done if error is None else None
        self.passes += 1
        self.rows += rows
        self.prefill_rows += prefill
        self.seconds += seconds
        if error is None and len(parts) > 1:
            self._fit = FIT_DECAY * self._fit + np.array([1.0, rows, seconds, rows * rows, rows * seconds])
        for m, part, result, failed in zip(members, parts, results, errors):
            m.rows, m.last = len(part[1]), done
            m.part, m.result, m.error = None, result, failed
            m.done.set()


def batchable(engine: Any) -> bool:
    """Whether `engine`'s passes can be batched (a SessionEngine's: batch-invariant kernels, a KV
    cache per session): the engine says so (core.model.engine.Engine.batches)."""
    return engine.batches


def default_max_batch(engine: Any, context: int) -> int:
    """How many requests of `context` tokens half of this machine's free memory holds the KV caches
    of (at most MAX_BATCH; 1 where the engine's passes are not batched)."""
    if not batchable(engine):
        return 1
    per_request = engine.kv_bytes_per_token * max(context, 1)
    free = free_memory()
    if free is None:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, free // 2 // per_request))

