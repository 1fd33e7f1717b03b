"""A learned curve's kept state (core.cost.curve.LearnedCurve.state), checked before it is believed.

A state comes back from a file an earlier run wrote, and anything may stand there by now (issue 39:
a list, counts past a float, a load of -1e6 that made every request divide by zero). So a state is
taken only when it fits the curve's grid and no machine's passes could be far from it; else
ValueError saying why, and the caller sets the file aside and starts from the prior.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

VERSION = 1  # the state's layout
KEPT_SECONDS = (1e-7, 1e3)  # a kept load: a one-token pass between these (far outside: the file is damaged)
MAX_KEPT_LOG_RATIO = math.log(1e8)  # nor a raw curve further than this from one token's time
MAX_KEPT_COUNT = 1e15  # nor counts of passes beyond this


class KeptState(NamedTuple):
    """A believable state: the curve's log shape g [C, S], its counts of pairs, the log seconds of
    a one-token pass, and how many passes and anchors taught it."""

    g: np.ndarray
    counts: np.ndarray
    load: float
    passes: int
    anchors: int


def check_state(state: Any, *, sizes: tuple[int, ...], contexts: tuple[int, ...]) -> KeptState:
    """The kept `state` if it fits this grid of `sizes` and `contexts` and is believable (finite,
    its load a one-token pass of KEPT_SECONDS, counts and passes non-negative and finite); else
    ValueError saying why."""
    if not isinstance(state, dict):
        raise ValueError(f"the state is a {type(state).__name__}, not an object")
    if state.get("version") != VERSION or not _same(state.get("sizes"), sizes) \
            or not _same(state.get("contexts"), contexts):
        raise ValueError("kept for another grid of sizes")
    try:
        g = np.asarray(state["g"], dtype=float)
        counts = np.asarray(state["counts"], dtype=float)
        load = state["load"]
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ValueError(f"not a curve: {type(exc).__name__}: {exc}") from None
    shape = (len(contexts), len(sizes))
    if g.shape != shape or counts.shape != shape or not (np.all(np.isfinite(g)) and np.all(np.isfinite(counts))):
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
    return KeptState(g, np.maximum(counts, 0.0), float(load), int(passes), int(anchors))


def _same(values: Any, expected: tuple[int, ...]) -> bool:
    return isinstance(values, list) and len(values) == len(expected) and all(
        _number(v) and v == e for v, e in zip(values, expected))


def _number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)  # an int of any size
