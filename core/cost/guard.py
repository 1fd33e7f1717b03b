"""The guard: whether drafts pay, checked against plain decoding on the steps themselves.

Whatever the cost curve says, the steps that carried drafts are checked against plain decoding's
time per token, measured in the same passes (each pass's time over the curve's shape says what a
one-token pass costs at that moment), or by plain steps a moment before (the anchors, the guard's
own plain steps), whichever is cheaper: the guard errs toward plain decoding. When drafts stop
paying, the draft size is capped, halved at each losing window down to zero (plain decoding), and
probed again later, more rarely each time it loses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

GUARD_STEPS = 12  # steps with a draft per verdict of the guard
LOSING = 1.0  # time per token with drafts / plain's above this: drafts are losing
WINNING = 0.95  # ... below this: they pay, and a cap may grow back
PROBE_STEPS = 32  # plain steps before drafts are tried again (doubled each time they lose ...)
MAX_PROBE_STEPS = 1024  # ... up to this)
PROBE_DRAFT = 2  # a probe's draft nodes: small drafts, to see whether they pay again
UNCAPPED_FROM = 32  # a cap this large that pays again is lifted (else doubled)
PLAIN_FRESH_S = 2.0  # plain steps this recent tell the guard what plain decoding costs now
RECENT_WEIGHT = 0.3  # the weight of the latest plain step in their running mean



def tighter(cap: int | None, ceiling: int | None) -> int | None:
    """The smaller of two caps on draft nodes, None being no cap.

    >>> tighter(None, 4), tighter(8, None), tighter(8, 1), tighter(None, None)
    (4, 8, 1, None)
    """
    return ceiling if cap is None else cap if ceiling is None else min(cap, ceiling)


class DraftGuard:
    """Caps drafts when they stop paying: `max_draft` before a step, `observe_step` after it.
    `shape(n, context)` is the cost curve's seconds(n) / seconds(1) (core.cost.curve.LearnedCurve.shape)."""

    def __init__(self, shape: Callable[[int, int], float], say: Callable[[str], None] = lambda message: None) -> None:
        self.shape = shape
        self.say = say
        self.cap: int | None = None  # most draft nodes a step may verify (None: no cap)
        self._spent = self._plain = 0.0
        self._steps = self._drafted = 0
        self._plain_steps = 0
        self._probe = PROBE_STEPS
        self._one, self._one_at = 0.0, -math.inf  # recent plain steps' seconds (their mean) and when

    def max_draft(self, *, anchor_due: bool = False) -> int | None:
        """The most draft nodes the next step may verify (None: as many as pay): a probe when plain
        decoding has run long enough, none when the curve asks for a plain pass (`anchor_due`: see
        core.cost.curve.LearnedCurve.anchor_due), else the cap."""
        if self.cap == 0 and self._plain_steps >= self._probe:
            return PROBE_DRAFT
        if anchor_due:
            return 0
        return self.cap

    def observe_step(self, *, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
                     num_out: int) -> None:
        """One decode step: a pass over `num_tokens` (the pending token and the draft) took
        `verify_seconds` of the step's `step_seconds` (drafting, sizing and learning included)
        and emitted `num_out` tokens. Plain decoding would have spent one one-token pass per
        token; this pass says what that costs now: verify_seconds / shape(num_tokens)."""
        now = time.monotonic()
        if num_tokens <= 1:
            if self.cap == 0:
                self._plain_steps += 1
            if step_seconds > 0 and math.isfinite(step_seconds):  # a plain step, measured whole
                fresh = now - self._one_at <= PLAIN_FRESH_S
                self._one = step_seconds if not fresh else self._one + RECENT_WEIGHT * (step_seconds - self._one)
                self._one_at = now
            return
        if not (verify_seconds > 0 and math.isfinite(step_seconds)):
            return
        per_token = verify_seconds / self.shape(num_tokens, context)
        if now - self._one_at <= PLAIN_FRESH_S:  # plain steps measured a moment ago: the cheaper says
            per_token = min(per_token, self._one)
        self.observe_priced(step_seconds, per_token, num_out, num_tokens - 1)

    def observe_priced(self, seconds: float, plain_per_token: float, num_out: int, drafted: float) -> None:
        """A step with `drafted` draft nodes that took `seconds` and emitted `num_out` tokens, where
        plain decoding costs `plain_per_token` a token (the caller priced it: observe_step, or the
        batched server's passes, core.serve.batch)."""
        self._spent += seconds
        self._plain += max(num_out, 1) * plain_per_token
        self._steps += 1
        self._drafted += drafted
        if self._steps >= GUARD_STEPS:
            self._judge()

    def observe_plain(self) -> None:
        """A step without drafts whose time says nothing here (the batched server's): it counts
        toward the next probe when drafts are off."""
        if self.cap == 0:
            self._plain_steps += 1

    def _judge(self) -> None:
        ratio = self._spent / self._plain
        mean = self._drafted / self._steps
        old = self.cap
        if ratio > LOSING:
            self.cap = int(mean // 2) if self.cap != 0 else 0
            if self.cap == 0:
                self._probe = min(self._probe * 2, MAX_PROBE_STEPS) if old == 0 else self._probe
                self._plain_steps = 0
        elif ratio < WINNING and self.cap is not None:
            self.cap = None if self.cap >= UNCAPPED_FROM else 2 * max(self.cap, PROBE_DRAFT)
            self._probe = PROBE_STEPS
        if self.cap != old:
            self.say(f"drafts {'are not paying' if ratio > LOSING else 'pay again'}: {ratio:.2f}x plain "
                     f"decoding's time per token over the last {self._steps} steps (mean draft {mean:.1f}); "
                     + ("draft size uncapped" if self.cap is None else
                        "decoding plainly" if self.cap == 0 else f"drafts capped at {self.cap} tokens"))
        self._spent = self._plain = 0.0
        self._steps = self._drafted = 0
