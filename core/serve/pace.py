"""A shaped stream's clock, as the wire and the decoding both keep it, and drafts that only run ahead of it.

Shaped (cli/http/shaping.py), every token of an answer takes one slot of a clock: the k-th leaves
at max(its slot, when it is ready), and after a late one the clock goes on from it. The slots are
a plain step's mean time apart plus a little (`Pace.interval`), and the k-th slot after the first
token lies a further `Pace.spread` x sqrt(k) out: a plain decoding whose steps vary at random
stays ahead of it with high probability however long it runs (its lag after k steps spreads as
sqrt(k)), for about the mean step per token and sqrt(k) spreads in all, where slots a rare slow
step apart would cost that step at every token. A step that verifies a draft costs more than a
plain one; if its draft loses, its token comes later than a plain step's would. So a shaped
request drafts only where it is ahead of its clock by enough that such a step, and a plain one
after it, still end before their slots, both at a high quantile (`PacedCost`): a drafted token
then never makes an event late, and the gaps on the wire are the clock's, or a plain step's where
decoding falls behind, whatever the drafts did (speculation still saves the server passes).

>>> clock = Clock(0.1)
>>> [round(clock.delay(t), 2) for t in (0.0, 0.05, 0.5, 0.55)], round(clock.slack(0.55), 2)
([0.0, 0.05, 0.0, 0.05], 0.15)
>>> clock = Clock(0.1, spread=0.02)  # gaps 0.1 + 0.02 (sqrt(k) - sqrt(k - 1)): 0.12, 0.108, ...
>>> [round(clock.delay(0.0), 3) for _ in range(3)], round(clock.hold_until(0.0, 3), 3)
([0.0, 0.12, 0.228], 0.228)
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cost.guard import tighter


@dataclass(frozen=True)
class Pace:
    """A shaped request's clock: slots `interval` seconds apart, the k-th after the first token
    `spread` x sqrt(k) further out; `steps[n]`: a whole step verifying 1 + n tokens takes at most
    that many seconds, but rarely (core.cost.learned.LearnedCost.step_bound; empty while no cost
    is learned: drafts then go by the cost alone)."""
    interval: float
    spread: float = 0.0
    steps: tuple[float, ...] = ()


class Clock:
    """A Pace's slots: `delay(now)` books the next token's (the one ready at `now`)."""

    def __init__(self, interval: float, spread: float = 0.0) -> None:
        self.interval, self.spread = max(0.0, float(interval)), max(0.0, float(spread))
        self.next: float | None = None  # the next token's slot (None: the first token starts the clock)
        self.booked = 0  # tokens booked

    @classmethod
    def of(cls, pace: Pace) -> Clock:
        return cls(pace.interval, pace.spread)

    def gap(self, k: int) -> float:
        """Seconds between the slots of the (k-1)-th and k-th tokens after the first (k >= 1)."""
        return self.interval + self.spread * (math.sqrt(k) - math.sqrt(k - 1))

    def delay(self, now: float) -> float:
        """Seconds to wait before the token ready at `now` may leave (and book the next slot)."""
        slot = now if self.next is None else max(self.next, now)
        self.booked += 1
        self.next = slot + self.gap(self.booked)
        return slot - now

    def book(self, tokens: int, now: float) -> None:
        """Book the slots of `tokens` tokens ready at `now` (what the wire will do when they reach it)."""
        for _ in range(tokens):
            self.delay(now)

    def slack(self, now: float) -> float:
        """How long before the next token's slot it may still be ready in time (0 before the first)."""
        return 0.0 if self.next is None else max(0.0, self.next - now)

    def hold_until(self, first: float, tokens: int) -> float:
        """When an answer of `tokens` tokens, its first ready at `first`, has had all its slots."""
        k = max(0, tokens - 1)
        return first + k * self.interval + self.spread * math.sqrt(k)


class PacedCost:
    """A request's PassCost (core.cost.forward) whose draft cap also asks its clock: n draft nodes
    only where a step of 1 + n tokens and a plain step after it fit before the next slot; the rest
    is the cost's own. `now`: the clock's time (the event loop's: time.monotonic)."""

    def __init__(self, base: Any, pace: Pace, clock: Clock, now: Callable[[], float] = time.monotonic) -> None:
        self.base, self.pace, self.clock, self.now = base, pace, clock, now

    def max_draft(self) -> int | None:
        cap = self.base.max_draft()
        steps = self.pace.steps
        if not steps:
            return cap
        slack = self.clock.slack(self.now())
        fits = [n for n in range(len(steps)) if steps[n] + steps[0] <= slack]
        return tighter(cap, fits[-1] if fits else 0)

    def __call__(self, n: int, context: int | None = None) -> float:
        return self.base(n, context)

    def __getattr__(self, name: str) -> Any:  # shape, observe_step, observe_pass, others: the cost's
        return getattr(self.base, name)
