"""The forward-pass cost curve, learned from the passes the engine runs: no timing at start-up.

Draft sizing (core.cost.sizing.size_draft) needs one thing from the hardware: how much dearer a
pass over n tokens is than a pass over one, at the cache length of the request. A curve timed
once at start cannot give it on a busy machine: the load changes by 10x within a minute, so a
start-up measurement is noise, and waiting for a quiet moment takes minutes. But two passes run
one after the other see the same load. So the cost is modelled as

    log seconds(n, context) = load(now) + g(n, context),    g(1, context) fixed (the prior's)

and g is learned from the difference of consecutive passes' log times (the load cancels out),
starting from a prior shape (the shipped curve) that serves until passes say otherwise. `load`
follows the latest passes, so the curve's seconds are today's, but only g decides a draft's size.

A curve is used only in a believable form (`_sane`): non-decreasing in n, and n tokens at most n
one-token passes (a pass over n tokens shares the weights' reads among them). Raw estimates that
break this (timing noise) are kept but never acted on. A confident curve that the passes
contradict pair after pair is forgotten (`Contradictions`). What is kept between runs is `state()`,
checked on the way back in (core.cost.kept_state).

    curve = LearnedCurve(prior)                   # prior: a ForwardCost, e.g. a shipped curve
    curve.observe(num_tokens, context, seconds)   # after every verification pass
    curve(8, 300) / curve(1, 300)                 # what 8 verified tokens cost against one, now
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .forward import ForwardCost, _curve
from .kept_state import VERSION, check_state

SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens verified, the cells learned (linear in between: each pass teaches two)
# the cache lengths the shape is learned at (linear in between, clamped beyond): at agents' context
# lengths a pass reads more cached keys and values than weights, and its shape is not a short prompt's
CONTEXTS = (128, 1024, 8192, 32768)

PRIOR_PASSES = 4.0  # the prior counts as this many observed pairs per cell
LEARNING_FLOOR = 0.1  # the smallest step size: the curve keeps following a machine that changes
MAX_ERROR = 0.7  # a pair's log-time error is clipped here: one preempted pass moves the curve little
PAIR_GAP_S = 0.5  # two passes further apart than this (plus their own time) may not share a load
PAIR_CONTEXT = 256  # nor two passes whose caches differ by more tokens than this
LOAD_WEIGHT = 0.3  # the weight of the latest pass in the load estimate
MIN_PRIOR_SECONDS = 1e-9  # a prior's pass costs at least this (its logarithm is taken)
SNAPSHOT_EVERY = 8  # passes between rebuilds of the believable curve (after each of the first too)
REPORT_EVERY = 64  # passes between checks whether the curve has changed enough to say so
REPORT_CHANGE = 0.35  # relative change of a reported ratio that is worth a log line
REPORTED_SIZES = (4, 8, 16, 32)  # the sizes a report gives against one token
CONTRADICTED = math.log(2.0)  # the last pairs off a confident curve by more than 2x (their median), one way ...
CONTRADICTIONS = 16  # ... over this many pairs: the curve is forgotten
CONFIDENT_PAIRS = 64  # cells learned from this many pairs (a curve kept from earlier runs) move slowly
ANCHOR_PASSES = 32  # at most this many passes in a row with drafts: then one plain pass (see anchor_due)
FIRST_ANCHORS = 16  # ... and every EARLY_ANCHOR_EVERY-th pass until this many one-token passes were paired
EARLY_ANCHOR_EVERY = 4


class _Pass(NamedTuple):
    """The last pass observed, what the next one is paired with."""

    weights: np.ndarray  # its interpolation weights [C, S]
    log_seconds: float
    end: float  # time.monotonic() when it was observed
    context: int
    tag: Any


class Contradictions:
    """Whether the passes contradict a confident curve: the errors of its last `count` pairs
    (log time) lean one way by more than `limit` (their median: a preempted pass does not count)."""

    def __init__(self, count: int = CONTRADICTIONS, limit: float = CONTRADICTED) -> None:
        self.limit = limit
        self._errors: deque[float] = deque(maxlen=count)

    def add(self, error: float) -> float | None:
        """One confident pair's error; the median drift when the curve is contradicted, else None."""
        self._errors.append(error)
        if len(self._errors) == self._errors.maxlen and abs(drift := float(np.median(self._errors))) > self.limit:
            self._errors.clear()
            return drift
        return None


class LearnedCurve:
    """A forward-cost curve (called like core.cost.forward.ForwardCost: seconds of a pass over n
    tokens on a cache of `context` tokens) that learns its shape from `observe`d passes.

    >>> curve = LearnedCurve(ForwardCost((1, 2, 4), (0.03, 0.03, 0.03)))  # a flat prior
    >>> for load in (1.0, 5.0, 2.0):  # but here 4 tokens cost twice one token, whatever the load
    ...     for _ in range(40):
    ...         curve.observe(1, 128, 0.03 * load, now=0.0)
    ...         curve.observe(4, 128, 0.06 * load, now=0.0)
    >>> round(curve(4, 128) / curve(1, 128), 2)
    2.0
    """

    def __init__(self, prior: ForwardCost, *, say: Callable[[str], None] = lambda message: None,
                 state: dict[str, Any] | None = None) -> None:
        self.say = say
        self.sizes = tuple(int(n) for n in SIZES)
        grid = np.array(self.sizes, dtype=float)
        prior_seconds = np.array([[prior(int(n), c) for n in grid] for c in CONTEXTS])  # [C, S]
        prior_seconds = np.maximum(prior_seconds, MIN_PRIOR_SECONDS)
        self.prior_g = np.log(prior_seconds / prior_seconds[:, :1])  # [C, S], 0 at n = 1
        self.offset = np.log(prior_seconds[:, 0] / prior_seconds[0, 0])  # [C]: a one-token pass per context
        self.g = self.prior_g.copy()
        self.counts = np.zeros_like(self.g)
        self.load = float(np.log(prior_seconds[0, 0]))  # log seconds of a one-token pass, 128-token cache, now
        self.passes = 0
        self._since_plain = 0  # passes since the last one-token pass
        self.anchors = 0  # pairs of a one-token pass and a larger one
        self._last_n = 0
        self._contradictions = Contradictions()
        self._last: _Pass | None = None
        self._reported = self._ratios()
        if state is not None:
            self._restore(state)
        self._snapshot = self._build()

    def __call__(self, n: int, context: int | None = None) -> float:
        return sum(w * _curve(self.sizes, self._grid[j], n) for j, w in _context_weights(context))

    def shape(self, n: int, context: int | None = None) -> float:
        """seconds(n) / seconds(1) at `context`, as the believable curve has it."""
        return self(n, context) / self(1, context)

    def snapshot(self) -> ForwardCost:
        """The believable curve, in today's seconds, as a fixed ForwardCost at the grid's two
        shortest contexts (for tables and files)."""
        return self._snapshot

    def at_contexts(self) -> dict[int, tuple[float, ...]]:
        """The believable curve's seconds over `sizes` at each context of the grid."""
        return {c: tuple(float(s) for s in row) for c, row in zip(CONTEXTS, self._grid)}

    def anchor_due(self) -> bool:
        """Whether the next pass should be a plain one (an anchor): after ANCHOR_PASSES passes with
        drafts (every EARLY_ANCHOR_EVERY-th until FIRST_ANCHORS were paired). A curve learns only
        differences between the sizes it sees, so without one-token passes beside the others its
        level against one token (what sizing and the guard need) would stay the prior's."""
        return self._since_plain >= (ANCHOR_PASSES if self.anchors >= FIRST_ANCHORS else EARLY_ANCHOR_EVERY)

    def observe(self, num_tokens: int, context: int, seconds: float, *, tag: Any = None,
                now: float | None = None) -> None:
        """Learn from one verification pass over `num_tokens` tokens on a cache of `context` tokens
        that took `seconds`. Passes with different `tag`s (e.g. thread counts) are never compared."""
        if not (seconds > 0 and math.isfinite(seconds)) or num_tokens < 1:
            return
        now = time.monotonic() if now is None else now
        w = _weights(self.sizes, num_tokens, context)
        y = math.log(seconds)
        last = self._last
        if (last is not None and last.tag == tag and abs(last.context - context) <= PAIR_CONTEXT
                and now - last.end <= PAIR_GAP_S + seconds):
            # the larger pass against the smaller: only the larger's cells learn (one token is the
            # unit, and each size is learned against smaller ones, so an error never pushes the
            # small sizes, which few pairs reach, down to make room above them)
            this = (w, y)
            before = (last.weights, last.log_seconds)
            (w_hi, y_hi), (w_lo, y_lo) = (this, before) if num_tokens >= self._last_n else (before, this)
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
        self._last = _Pass(w, y, now, context, tag)
        self._since_plain = 0 if num_tokens == 1 else self._since_plain + 1
        self._last_n = num_tokens
        predicted = float(np.sum(w * (_sane(self.g) + self.offset[:, None])))
        self.load += LOAD_WEIGHT * (y - predicted - self.load)
        self.passes += 1
        if self.passes % SNAPSHOT_EVERY == 0 or self.passes < SNAPSHOT_EVERY:
            self._snapshot = self._build()
        if self.passes % REPORT_EVERY == 0:
            self._report()

    def _check_contradiction(self, error: float, grad: np.ndarray) -> None:
        """A confident curve (its cells learned from many pairs, e.g. kept from an earlier run) that
        the passes contradict is not this machine's (another machine's file, a poisoned one): at
        LEARNING_FLOOR its cells would take dozens of pairs to move while sizing trusts them. So it
        is forgotten: the prior's shape again, learned afresh at full rate. A curve still learning
        from few pairs is never forgotten (it is moving toward the passes)."""
        reach = float(np.sum(np.abs(grad)))
        if float(np.sum(np.abs(grad) * self.counts)) / max(reach, _TINY) < CONFIDENT_PAIRS:
            return
        drift = self._contradictions.add(error)
        if drift is not None:
            self.say(f"forward-pass cost: the passes contradict the curve (larger passes {math.exp(abs(drift)):.1f}x "
                     f"{'dearer' if drift > 0 else 'cheaper'} than it says, the median of {CONTRADICTIONS} pairs): "
                     f"learning it again from the shipped shape")
            self.g, self.counts = self.prior_g.copy(), np.zeros_like(self.counts)
            self._snapshot = self._build()

    def _build(self) -> ForwardCost:
        seconds = np.exp(self.load + self.offset[:, None] + _sane(self.g))  # [C, S]
        self._grid = seconds
        return ForwardCost(self.sizes, tuple(float(s) for s in seconds[0]), CONTEXTS[0],
                           tuple(float(s) for s in seconds[1]), CONTEXTS[1])

    def _ratios(self) -> list[float]:
        sane = np.exp(_sane(self.g)[0])
        return [float(sane[self.sizes.index(n)]) for n in REPORTED_SIZES]

    def _report(self) -> None:
        ratios = self._ratios()
        if any(abs(r / old - 1) > REPORT_CHANGE for r, old in zip(ratios, self._reported)):
            self.say(f"forward-pass cost learned from {self.passes} passes: "
                     + ", ".join(f"{n} tokens {r:.2f}x" for n, r in zip(REPORTED_SIZES, ratios))
                     + " one token (was " + ", ".join(f"{r:.2f}x" for r in self._reported) + ")")
            self._reported = ratios

    def state(self) -> dict[str, Any]:
        """What to keep between runs (JSON-ready): the shape and how much of it was learned."""
        return {"version": VERSION, "sizes": list(self.sizes), "contexts": list(CONTEXTS), "g": self.g.tolist(),
                "counts": self.counts.tolist(), "load": self.load, "passes": self.passes, "anchors": self.anchors,
                "curve_ms": {str(n): round(1e3 * s, 3) for n, s in zip(self.sizes, self._snapshot.seconds)}}

    def _restore(self, state: Any) -> None:
        """A kept state, if it fits this grid and is believable (core.cost.kept_state.check_state);
        else ValueError saying why (the caller sets the file aside and starts from the prior)."""
        kept = check_state(state, sizes=self.sizes, contexts=CONTEXTS)
        self.g, self.counts, self.load = kept.g, kept.counts, kept.load
        self.passes, self.anchors = kept.passes, kept.anchors
        self._reported = self._ratios()


_TINY = 1e-9  # guards a division by a sum of weights that may be zero


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
    for j, wc in _context_weights(context):
        for i, wn in col:
            w[j, i] += wc * wn
    return w


def _context_weights(context: int | None) -> list[tuple[int, float]]:
    """(index in CONTEXTS, weight) of a cache length: linear between its two neighbours, clamped to
    the grid; None: the shortest (as ForwardCost).

    >>> _context_weights(4608), _context_weights(100_000)
    ([(1, 0.5), (2, 0.5)], [(3, 1.0)])
    """
    if context is None:
        return [(0, 1.0)]
    c = min(max(context, CONTEXTS[0]), CONTEXTS[-1])
    hi = int(np.searchsorted(CONTEXTS, c))
    if CONTEXTS[hi] == c:
        return [(hi, 1.0)]
    t = (c - CONTEXTS[hi - 1]) / (CONTEXTS[hi] - CONTEXTS[hi - 1])
    return [(hi - 1, 1.0 - t), (hi, t)]
