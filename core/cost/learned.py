"""The learned cost: the curve learned from the passes (core.cost.curve) and the guard that caps
drafts when they stop paying (core.cost.guard), as the one PassCost the decode loop is given; and
where it is kept between runs, a file its caller names.

    cost = load_learned_cost(prior, kept_at=path, key=key, say=print)   # what earlier runs learned
    ... decode(..., cost=cost) ...                                      # every step teaches it
    cost.keep()                                                         # for the next run
"""

from __future__ import annotations

import copy
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..kept import Unusable, read_kept_json, set_aside, write_kept_json
from .curve import LearnedCurve
from .forward import ForwardCost
from .guard import DraftGuard, tighter

STEP_WINDOW = 512  # the recent steps whose whole time over their pass's learned cost says how long a step runs
STEP_QUANTILE = 0.95  # ... read at this quantile by step_bound
PLAIN_SEEN = 32  # one-token steps seen before their own spread is a plain step's (all steps' until then)


class LearnedCost:
    """A forward-pass cost (core.cost.forward.PassCost) learned from the steps it is shown: `curve`
    sizes drafts and learns from each pass, `guard` caps drafts that do not pay. `kept_at` (the
    caller's choice; None: not kept) is the file `keep` writes, with `key` (what the curve was
    learned on: model, engine, machine) beside the state.

    >>> cost = LearnedCost(ForwardCost((1, 4), (0.01, 0.02)))
    >>> cost.max_draft() is None, round(cost.shape(4, 128), 2)
    (True, 2.0)
    """

    def __init__(self, prior: ForwardCost, *, say: Callable[[str], None] = lambda message: None,
                 state: dict[str, Any] | None = None, kept_at: Path | None = None,
                 key: Mapping[str, Any] | None = None) -> None:
        self.curve = LearnedCurve(prior, say=say, state=state)
        self.guard = DraftGuard(self.curve.shape, say)
        self.ceiling: int | None = None  # draft nodes a step verifies at most, whatever pays (None: no ceiling)
        self._steps: deque[float] = deque(maxlen=STEP_WINDOW)  # recent steps' seconds over their pass's cost
        self._plain: deque[float] = deque(maxlen=STEP_WINDOW)  # ... of the one-token steps among them
        self.kept_at = kept_at
        self.key = dict(key or {})

    def __call__(self, n: int, context: int | None = None) -> float:
        return self.curve(n, context)

    def with_guard(self, guard: DraftGuard) -> LearnedCost:
        """This cost judged by `guard`: the same curve (it measures the machine: every pass teaches
        it), the guard's own verdicts on whether drafts pay (a tenant's: core.serve.worker)."""
        view = copy.copy(self)
        view.guard = guard
        return view

    def shape(self, n: int, context: int | None = None) -> float:
        return self.curve.shape(n, context)

    def snapshot(self) -> ForwardCost:
        """The believable curve, in today's seconds (core.cost.curve.LearnedCurve.snapshot)."""
        return self.curve.snapshot()

    @property
    def passes(self) -> int:
        """How many passes taught the curve (earlier runs' included)."""
        return self.curve.passes

    def max_draft(self) -> int | None:
        return tighter(self.guard.max_draft(anchor_due=self.curve.anchor_due()), self.ceiling)

    def step_bound(self, n: int, context: int | None = None) -> float:
        """Seconds a whole step verifying `n` tokens takes at most, but rarely: the pass's learned
        cost times the STEP_QUANTILE of recent steps' whole time over what the curve says their
        pass costs (the pass's own spread, drafting, sampling and the loop's own work; 1 before
        any step was seen)."""
        ratios = sorted(self._steps)
        factor = ratios[min(len(ratios) - 1, int(STEP_QUANTILE * len(ratios)))] if ratios else 1.0
        return self.curve(n, context) * max(1.0, factor)

    def plain_step(self, context: int | None = None) -> tuple[float, float]:
        """(mean, spread) of a plain step's whole seconds on a `context`-token cache: the one-token
        pass's learned cost times the mean of recent one-token steps' time over their pass's cost,
        and times their spread (the interquartile range over 1.349: a standard deviation that a
        rare stall does not inflate); all steps' until PLAIN_SEEN one-token ones were seen."""
        ratios = sorted(self._plain if len(self._plain) >= PLAIN_SEEN else self._steps)
        one = self.curve(1, context)
        if len(ratios) < 4:
            return one, 0.0
        quartile = len(ratios) // 4
        return one * statistics.fmean(ratios), one * (ratios[-1 - quartile] - ratios[quartile]) / 1.349

    def observe_step(self, *, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
                     num_out: int, tag: Any = None) -> None:
        """A decode step: its pass teaches the curve, then the step tells the guard whether drafts pay."""
        self.curve.observe(num_tokens, context, verify_seconds, tag=tag)
        expected = self.curve(num_tokens, context)
        if expected > 0 and step_seconds >= verify_seconds > 0:
            self._steps.append(ratio := step_seconds / expected)
            if num_tokens == 1:
                self._plain.append(ratio)
        self.guard.observe_step(num_tokens=num_tokens, context=context, verify_seconds=verify_seconds,
                                step_seconds=step_seconds, num_out=num_out)

    def observe_pass(self, num_tokens: int, context: int, seconds: float, tag: Any = None) -> None:
        """A pass several requests shared teaches the curve only (the guard judges one request's steps)."""
        self.curve.observe(num_tokens, context, seconds, tag=tag)

    def others(self) -> tuple[int, float]:
        return 0, 0.0

    def keep(self) -> None:
        """Write what the curve has learned to `kept_at` (beside it and renamed into place: nothing
        is left behind when that fails; OSError or ValueError then). Nothing without a file or a pass."""
        if self.kept_at is None or not self.curve.passes:
            return
        write_kept_json(self.kept_at, {"key": self.key, "state": self.curve.state()})


def load_learned_cost(prior: ForwardCost, *, kept_at: Path, key: Mapping[str, Any],
                      say: Callable[[str], None] = lambda message: None, relearn: bool = False) -> LearnedCost:
    """The learned cost kept in `kept_at` by an earlier run (`relearn`: forgotten), else a new one
    from `prior`'s shape. A file that cannot be used is set aside, with one line saying why, and
    the start goes on from the prior (core.kept)."""
    if not relearn:
        try:
            doc = read_kept_json(kept_at)  # a regular file of at most core.kept.MAX_BYTES, else Unusable
            if doc is not None:
                if not isinstance(doc, dict) or "state" not in doc:
                    raise Unusable("holds no learned state")
                cost = LearnedCost(prior, say=say, state=doc["state"], kept_at=kept_at, key=key)  # ValueError: unbelievable
                say(f"forward-pass cost: as learned by earlier runs ({cost.passes} passes; {kept_at})")
                return cost
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with a kept file, a start goes on without it
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            aside = set_aside(kept_at)
            where = f"set aside as {aside.name}" if aside is not None else "it could not be set aside"
            say(f"forward-pass cost: cannot use {kept_at} ({why}): {where}; starting from the shipped curve's shape")
            return LearnedCost(prior, say=say, kept_at=kept_at, key=key)
    say("forward-pass cost: starting from the shipped curve's shape; learned from the passes as they run")
    return LearnedCost(prior, say=say, kept_at=kept_at, key=key)
