"""What a forward pass costs: a fixed curve (`ForwardCost`), the interface the decode loop asks of
any cost (`PassCost`), and the check a measured curve must pass to be believed (`check_curve`).

On a CPU the time of one verification pass grows quickly with the number of tokens verified; on
a GPU it is nearly flat for small trees. So the right draft size depends on the hardware: a curve
seconds(n), fixed (measured once: specx.bench.calibrate, `specx bench cost`; or shipped:
core.cost.shipped) or learned from the passes themselves (core.cost.learned.LearnedCost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

LONG_FLOOR = 0.25  # extrapolated to a short cache, a pass costs at least this share of the short curve's


class PassCost(Protocol):
    """What the decode loop (core.decode.loop) asks of a forward-pass cost, fixed or learned: the
    seconds of a pass (to size drafts by), its shape (to compare passes of different sizes by), the
    most draft nodes the next step may verify, and each step's timing to learn from. A fixed curve
    (`FixedCost`) caps nothing and learns nothing."""

    def __call__(self, n: int, context: int | None = None) -> float:
        """Seconds (or a relative cost) of one pass over `n` tokens on a cache of `context` tokens."""

    def shape(self, n: int, context: int | None = None) -> float:
        """seconds(n) / seconds(1) at `context`."""

    def max_draft(self) -> int | None:
        """The most draft nodes the next step may verify (None: as many as pay)."""

    def observe_step(self, *, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
                     num_out: int, tag: Any = None) -> None:
        """One decode step: its pass over `num_tokens` tokens on a `context`-token cache took
        `verify_seconds` of the step's `step_seconds` and emitted `num_out` tokens; `tag` tells
        passes apart that must not be compared (e.g. thread counts)."""

    def observe_pass(self, num_tokens: int, context: int, seconds: float, tag: Any = None) -> None:
        """A pass that several requests shared (core.serve.batch): its shape only (a step of one
        request's says nothing of whether its drafts pay)."""

    def others(self) -> tuple[int, float]:
        """(rows, tokens) of the other requests that share the next pass: (0, 0.0) but in the
        batched server (core.cost.sizing.size_draft)."""


class FixedCost:
    """The learning half of PassCost for a curve that never changes: no cap, nothing learned."""

    def shape(self, n: int, context: int | None = None) -> float:
        return self(n, context) / self(1, context)  # type: ignore[operator]

    def max_draft(self) -> int | None:
        return None

    def observe_step(self, *, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
                     num_out: int, tag: Any = None) -> None:
        return None

    def observe_pass(self, num_tokens: int, context: int, seconds: float, tag: Any = None) -> None:
        return None

    def others(self) -> tuple[int, float]:
        return 0, 0.0


@dataclass(frozen=True)
class ForwardCost(FixedCost):
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
        return max(short + w * (_curve(self.sizes, self.long_seconds, n) - short), LONG_FLOOR * short)


def _curve(sizes: Sequence[int], seconds: Sequence[float], n: int) -> float:
    xs, ys = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if n <= xs[-1] or len(xs) < 2:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (n - xs[-1]))


# ------------------------------------------------------------------------------- a curve to trust

CURVE_TOLERANCE = 0.25  # timing noise a measured curve may show above k one-token passes
CHEAPER_LIMIT = 0.5  # a longer pass may cost this share of a shorter one, no less (kernels differ by size)


def check_curve(cost: ForwardCost, *, tolerance: float = CURVE_TOLERANCE, cheaper: float = CHEAPER_LIMIT) -> str | None:
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
