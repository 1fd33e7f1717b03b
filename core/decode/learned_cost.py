"""The forward-pass cost curve, learned from the passes the engine runs: no timing at start-up.

Draft sizing (core.decode.cost.size_draft) needs one thing from the hardware: how much dearer a pass over
n tokens is than a pass over one, at the cache length of the request. A curve timed once at start
cannot give it on a busy machine: the load changes by 10x within a minute, so a start-up
measurement is noise, and waiting for a quiet moment takes minutes. But two passes run one after
the other see the same load. So the cost is modelled as

    log seconds(n, context) = load(now) + g(n, context),    g(1, context) fixed (the prior's)

and g is learned from the difference of consecutive passes' log times (the load cancels out),
starting from a prior shape (the shipped curve) that serves until passes say otherwise. `load`
follows the latest passes, so the curve's seconds are today's, but only g decides a draft's size.

A curve is used only in a believable form (`sane`): non-decreasing in n, and n tokens at most n
one-token passes (a pass over n tokens shares the weights' reads among them). Raw estimates that
break this (timing noise) are kept but never acted on.

The guard: whatever the estimates say, the steps that carried drafts are checked against plain
decoding's time per token, measured in the same passes (each pass's time over g says what a
one-token pass costs at that moment), or by plain steps a moment before (the anchors, the guard's
own plain steps), whichever is cheaper: the guard errs toward plain decoding. When drafts stop paying, the draft size is capped, halved
at each losing window down to zero (plain decoding), and probed again later, more rarely each
time it loses.

    cost = LearnedCost(prior)              # prior: a ForwardCost, e.g. the shipped cpu curve
    cost.observe(num_tokens, context, seconds)   # after every verification pass
    cost(8, 300) / cost(1, 300)            # what 8 verified tokens cost against one, now
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .cost import ForwardCost

SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens verified, the cells learned (linear in between: each pass teaches two)
CONTEXTS = (128, 1024)  # the cache lengths the shape is learned at (linear in between, as ForwardCost)
PRIOR_PASSES = 4.0  # the prior counts as this many observed pairs per cell
LEARNING_FLOOR = 0.1  # the smallest step size: the curve keeps following a machine that changes
MAX_ERROR = 0.7  # a pair's log-time error is clipped here: one preempted pass moves the curve little
PAIR_GAP_S = 0.5  # two passes further apart than this (plus their own time) may not share a load
PAIR_CONTEXT = 256  # nor two passes whose caches differ by more tokens than this
LOAD_WEIGHT = 0.3  # the weight of the latest pass in the load estimate
REPORT_EVERY = 64  # passes between checks whether the curve has changed enough to say so
REPORT_CHANGE = 0.35  # relative change of a reported ratio that is worth a log line
CONTRADICTED = math.log(2.0)  # the last pairs off a confident curve by more than 2x (their median), one way ...
CONTRADICTIONS = 16  # ... over this many pairs: the curve is forgotten
CONFIDENT_PAIRS = 64  # cells learned from this many pairs (a curve kept from earlier runs) move slowly
GUARD_STEPS = 12  # steps with a draft per verdict of the guard
LOSING = 1.0  # time per token with drafts / plain's above this: drafts are losing
WINNING = 0.95  # ... below this: they pay, and a cap may grow back
PROBE_STEPS = 32  # plain steps before drafts are tried again (doubled each time they lose, to 1024)
PLAIN_FRESH_S = 2.0  # plain steps this recent tell the guard what plain decoding costs now
ANCHOR_PASSES = 32  # at most this many passes in a row with drafts: then one plain pass (see max_draft)
FIRST_ANCHORS = 16  # ... and every 4th pass until this many one-token passes were paired with others


class LearnedCost:
    """A forward-cost curve (called like core.decode.cost.ForwardCost: seconds of a pass over n tokens on
    a cache of `context` tokens) that learns its shape from `observe`d passes, and a guard
    (`max_draft`, fed by `observe_step`) that caps drafts when they stop paying.

    >>> cost = LearnedCost(ForwardCost((1, 2, 4), (0.03, 0.03, 0.03)))  # a flat prior
    >>> for load in (1.0, 5.0, 2.0):  # but here 4 tokens cost twice one token, whatever the load
    ...     for _ in range(40):
    ...         cost.observe(1, 128, 0.03 * load, now=0.0)
    ...         cost.observe(4, 128, 0.06 * load, now=0.0)
    >>> round(cost(4, 128) / cost(1, 128), 2)
    2.0
    """

    def __init__(self, prior: ForwardCost, say: Callable[[str], None] = lambda message: None,
                 state: dict[str, Any] | None = None) -> None:
        self.say = say
        self.kept_at: Any = None  # where its owner keeps it between runs (cli.options.keep_cost), and by what key
        self.key: dict[str, Any] = {}
        self.sizes = tuple(int(n) for n in SIZES)
        grid = np.array(self.sizes, dtype=float)
        prior_seconds = np.array([[prior(int(n), c) for n in grid] for c in CONTEXTS])  # [C, S]
        prior_seconds = np.maximum(prior_seconds, 1e-9)
        self.prior_g = np.log(prior_seconds / prior_seconds[:, :1])  # [C, S], 0 at n = 1
        self.offset = np.log(prior_seconds[:, 0] / prior_seconds[0, 0])  # [C]: a one-token pass per context
        self.g = self.prior_g.copy()
        self.counts = np.zeros_like(self.g)
        self.load = float(np.log(prior_seconds[0, 0]))  # log seconds of a one-token pass, 128-token cache, now
        self.passes = 0
        self._since_plain = 0  # passes since the last one-token pass
        self.anchors = 0  # pairs of a one-token pass and a larger one
        self._last_n = 0
        self._errors: deque[float] = deque(maxlen=CONTRADICTIONS)  # the last confident pairs' errors (log time)
        self._last: tuple[np.ndarray, float, float, int, Any] | None = None  # weights, log s, end time, context, tag
        self._reported = self._ratios()
        # the guard
        self.cap: int | None = None  # most draft nodes a step may verify (None: no cap)
        self._spent = self._plain = 0.0
        self._steps = self._drafted = 0
        self._plain_steps = 0
        self._probe = PROBE_STEPS
        self._one, self._one_at = 0.0, -math.inf  # recent plain steps' seconds (their mean) and when
        if state is not None:
            self._restore(state)
        self._snapshot = self._build()

    # ------------------------------------------------------------------ the curve

    def __call__(self, n: int, context: int | None = None) -> float:
        return self._snapshot(n, context)

    def shape(self, n: int, context: int | None = None) -> float:
        """seconds(n) / seconds(1) at `context`, as the believable curve has it."""
        return self._snapshot(n, context) / self._snapshot(1, context)

    def snapshot(self) -> ForwardCost:
        """The believable curve, in today's seconds, as a fixed ForwardCost (for tables and files)."""
        return self._snapshot

    def observe(self, num_tokens: int, context: int, seconds: float, tag: Any = None,
                now: float | None = None) -> None:
        """Learn from one verification pass over `num_tokens` tokens on a cache of `context` tokens
        that took `seconds`. Passes with different `tag`s (e.g. thread counts) are never compared."""
        if not (seconds > 0 and math.isfinite(seconds)) or num_tokens < 1:
            return
        now = time.monotonic() if now is None else now
        w = _weights(self.sizes, num_tokens, context)
        y = math.log(seconds)
        last = self._last
        if (last is not None and last[4] == tag and abs(last[3] - context) <= PAIR_CONTEXT
                and now - last[2] <= PAIR_GAP_S + seconds):
            # the larger pass against the smaller: only the larger's cells learn (one token is the
            # unit, and each size is learned against smaller ones, so an error never pushes the
            # small sizes, which few pairs reach, down to make room above them)
            (w_hi, y_hi), (w_lo, y_lo) = ((w, y), last[:2]) if num_tokens >= self._last_n else (last[:2], (w, y))
            grad = w_hi - w_lo
            grad[:, : int(np.flatnonzero(w_lo.any(axis=0)).max()) + 1] = 0.0
            if np.any(grad):
                self.anchors += (num_tokens == 1) != (self._last_n == 1)
                error = (y_hi - y_lo) - float(np.sum((w_hi - w_lo) * (self.g + self.offset[:, None])))
                self._check_contradiction(error, grad)
                error = max(-MAX_ERROR, min(MAX_ERROR, error))
                rate = np.maximum(1.0 / (self.counts + PRIOR_PASSES), LEARNING_FLOOR)
                self.g += rate * error * grad
                self.counts += np.abs(grad)
        self._last = (w, y, now, context, tag)
        self._since_plain = 0 if num_tokens == 1 else self._since_plain + 1
        self._last_n = num_tokens
        predicted = float(np.sum(w * (_sane(self.g) + self.offset[:, None])))
        self.load += LOAD_WEIGHT * (y - predicted - self.load)
        self.passes += 1
        if self.passes % 8 == 0 or self.passes < 8:
            self._snapshot = self._build()
        if self.passes % REPORT_EVERY == 0:
            self._report()

    def _check_contradiction(self, error: float, grad: np.ndarray) -> None:
        """A confident curve (its cells learned from many pairs, e.g. kept from an earlier run) whose
        last CONTRADICTIONS pairs err by more than CONTRADICTED one way (their median: a preempted
        pass does not count) is not this machine's (another machine's file, a poisoned one): at
        LEARNING_FLOOR its cells would take dozens of pairs to move while sizing trusts them. So it
        is forgotten: the prior's shape again, learned afresh at full rate. A curve still learning
        from few pairs is never forgotten (it is moving toward the passes)."""
        confident = float(np.sum(np.abs(grad) * self.counts) / max(np.sum(np.abs(grad)), 1e-9)) >= CONFIDENT_PAIRS
        if not confident:
            return
        self._errors.append(error)
        if len(self._errors) == CONTRADICTIONS and abs(drift := float(np.median(self._errors))) > CONTRADICTED:
            self.say(f"forward-pass cost: the passes contradict the curve (larger passes {math.exp(abs(drift)):.1f}x "
                     f"{'dearer' if drift > 0 else 'cheaper'} than it says, the median of {CONTRADICTIONS} pairs): "
                     f"learning it again from the shipped shape")
            self.g, self.counts = self.prior_g.copy(), np.zeros_like(self.counts)
            self._errors.clear()
            self._snapshot = self._build()

    def _build(self) -> ForwardCost:
        seconds = np.exp(self.load + self.offset[:, None] + _sane(self.g))  # [C, S]
        return ForwardCost(self.sizes, tuple(float(s) for s in seconds[0]), CONTEXTS[0],
                           tuple(float(s) for s in seconds[1]), CONTEXTS[1])

    def _ratios(self) -> list[float]:
        sane = np.exp(_sane(self.g)[0])
        return [float(sane[self.sizes.index(n)]) for n in (4, 8, 16, 32)]

    def _report(self) -> None:
        ratios = self._ratios()
        if any(abs(r / old - 1) > REPORT_CHANGE for r, old in zip(ratios, self._reported)):
            self.say(f"forward-pass cost learned from {self.passes} passes: "
                     + ", ".join(f"{n} tokens {r:.2f}x" for n, r in zip((4, 8, 16, 32), ratios))
                     + " one token (was " + ", ".join(f"{r:.2f}x" for r in self._reported) + ")")
            self._reported = ratios

    # ------------------------------------------------------------------ the guard

    def max_draft(self) -> int | None:
        """The most draft nodes the next step may verify (None: as many as pay).

        After ANCHOR_PASSES passes with drafts, one plain pass: a curve learns only differences
        between the sizes it sees, so without one-token passes beside the others its level against
        one token (what sizing and the guard need) would stay the prior's."""
        if self.cap == 0 and self._plain_steps >= self._probe:
            return 2  # a probe: small drafts, to see whether they pay again
        if self._since_plain >= (ANCHOR_PASSES if self.anchors >= FIRST_ANCHORS else 4):
            return 0
        return self.cap

    def observe_step(self, num_tokens: int, context: int, verify_seconds: float, step_seconds: float,
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
                self._one = step_seconds if not fresh else self._one + LOAD_WEIGHT * (step_seconds - self._one)
                self._one_at = now
            return
        if not (verify_seconds > 0 and math.isfinite(step_seconds)):
            return
        per_token = verify_seconds / self.shape(num_tokens, context)
        if now - self._one_at <= PLAIN_FRESH_S:  # plain steps measured a moment ago: the cheaper says
            per_token = min(per_token, self._one)
        self._spent += step_seconds
        self._plain += max(num_out, 1) * per_token
        self._steps += 1
        self._drafted += num_tokens - 1
        if self._steps >= GUARD_STEPS:
            self._judge()

    def _judge(self) -> None:
        ratio = self._spent / self._plain
        mean = self._drafted / self._steps
        old = self.cap
        if ratio > LOSING:
            self.cap = int(mean // 2) if self.cap != 0 else 0
            if self.cap == 0:
                self._probe = min(self._probe * 2, 1024) if old == 0 else self._probe
                self._plain_steps = 0
        elif ratio < WINNING and self.cap is not None:
            self.cap = None if self.cap >= 32 else 2 * max(self.cap, 2)  # a probe ran at 2
            self._probe = PROBE_STEPS
        if self.cap != old:
            self.say(f"drafts {'are not paying' if ratio > LOSING else 'pay again'}: {ratio:.2f}x plain "
                     f"decoding's time per token over the last {self._steps} steps (mean draft {mean:.1f}); "
                     + ("draft size uncapped" if self.cap is None else
                        "decoding plainly" if self.cap == 0 else f"drafts capped at {self.cap} tokens"))
        self._spent = self._plain = 0.0
        self._steps = self._drafted = 0

    # ------------------------------------------------------------------ keeping it

    def state(self) -> dict[str, Any]:
        """What to keep between runs (JSON-ready): the shape and how much of it was learned."""
        return {"version": 1, "sizes": list(self.sizes), "contexts": list(CONTEXTS), "g": self.g.tolist(),
                "counts": self.counts.tolist(), "load": self.load, "passes": self.passes, "anchors": self.anchors,
                "curve_ms": {str(n): round(1e3 * s, 3) for n, s in zip(self.sizes, self._snapshot.seconds)}}

    def _restore(self, state: Any) -> None:
        """A kept state, if it fits this grid and is believable (finite, its load a one-token pass of
        KEPT_SECONDS, counts and passes non-negative and finite); else ValueError saying why (the
        caller sets the file aside and starts from the prior)."""
        if not isinstance(state, dict):
            raise ValueError(f"the state is a {type(state).__name__}, not an object")
        if state.get("version") != 1 or not _same(state.get("sizes"), self.sizes) \
                or not _same(state.get("contexts"), CONTEXTS):
            raise ValueError("kept for another grid of sizes")
        try:
            g = np.asarray(state["g"], dtype=float)
            counts = np.asarray(state["counts"], dtype=float)
            load = state["load"]
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a curve: {type(exc).__name__}: {exc}") from None
        if g.shape != self.g.shape or counts.shape != self.g.shape or not (
                np.all(np.isfinite(g)) and np.all(np.isfinite(counts))):
            raise ValueError("not a finite curve of the right shape")
        if np.any(np.abs(g) > MAX_KEPT_LOG_RATIO) or np.any(counts > MAX_KEPT_COUNT):
            raise ValueError("a curve no machine gives (a pass over n tokens 1e8 times one token's, or less)")
        low, high = math.log(KEPT_SECONDS[0]), math.log(KEPT_SECONDS[1])
        if not (_number(load) and low <= load <= high):
            raise ValueError(f"load {load!r} is not the log of {KEPT_SECONDS[0]:g} to {KEPT_SECONDS[1]:g} seconds")
        passes, anchors = state.get("passes", 0), state.get("anchors", 0)
        for name, value in (("passes", passes), ("anchors", anchors)):
            if not (_number(value) and 0 <= value <= MAX_KEPT_COUNT):
                raise ValueError(f"{name} {value!r} is not a count")
        self.g, self.counts, self.load = g, np.maximum(counts, 0.0), float(load)
        self.passes = int(passes)
        self.anchors = int(anchors)
        self._reported = self._ratios()


KEPT_SECONDS = (1e-7, 1e3)  # a kept load: a one-token pass between these (far outside: the file is damaged)
MAX_KEPT_LOG_RATIO = math.log(1e8)  # nor a raw curve further than this from one token's time
MAX_KEPT_COUNT = 1e15  # nor counts of passes beyond this


def _same(values: Any, expected: tuple[int, ...]) -> bool:
    return isinstance(values, list) and len(values) == len(expected) and all(
        _number(v) and v == e for v, e in zip(values, expected))


def _number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)  # an int of any size


def _sane(g: np.ndarray) -> np.ndarray:
    """Each context's curve made believable: 0 at one token, non-decreasing in n, at most log(n)
    (n tokens cost no more than n one-token passes). `g` is [C, S] over SIZES.

    >>> _sane(np.array([[0.0, 0.5, 0.2, 9.0] + [0.0] * (len(SIZES) - 4)]))[0, :4].round(2).tolist()
    [0.0, 0.5, 0.5, 2.08]
    """
    out = np.maximum.accumulate(g, axis=1)
    out[:, 0] = 0.0
    out = np.maximum.accumulate(out, axis=1)
    return np.minimum(out, np.log(np.array(SIZES, dtype=float)))


def _weights(sizes: tuple[int, ...], n: int, context: int) -> np.ndarray:
    """Interpolation weights [C, S] of a pass over n tokens on a `context`-token cache (clamped to
    the grid: beyond it, the nearest cell learns)."""
    w = np.zeros((len(CONTEXTS), len(sizes)))
    x = min(max(n, sizes[0]), sizes[-1])
    hi = int(np.searchsorted(sizes, x))
    if sizes[hi] == x:
        col = [(hi, 1.0)]
    else:
        t = (x - sizes[hi - 1]) / (sizes[hi] - sizes[hi - 1])
        col = [(hi - 1, 1.0 - t), (hi, t)]
    c = min(max((context - CONTEXTS[0]) / (CONTEXTS[1] - CONTEXTS[0]), 0.0), 1.0)
    for j, wc in ((0, 1.0 - c), (1, c)):
        for i, wn in col:
            w[j, i] += wc * wn
    return w
