"""How many threads a forward pass runs on, chosen from the passes themselves.

A decode step on a small model is hundreds of short parallel regions (OpenMP in torch, numba's in
core.model.transformers.matmul), each ending in a barrier. On idle cores two threads are faster
than one. On busy cores a thread is often descheduled, and its sibling waits at every barrier for
the scheduler to bring it back: measured on the 2-core machine with four spinning processes beside
it, plain decoding of the built-in model ran at 0.3 tokens/s on two threads and 3.5 on one (quiet:
17 and 17). The load comes and goes, so no setting chosen at start is right for long: the tuner
runs most passes on its current setting, now and then one on the other, and switches when that one
was clearly faster than the passes just before it. A probe that loses makes the next one rarer (on
a busy machine, a pass on the wrong setting costs ~10x one on the right one).

The tuner is the engine's (core.model.engine.Engine.tune_threads makes it, one for all its
sessions and every request of a run), and the engine's passes are its only users: each runs inside
`timed`. Neither the decode loop nor the batched server chooses or times threads; they read `last`
to tag the timings their costs learn from (passes on different thread counts are never paired).

    tuner = ThreadTuner((2, 1), apply=set_threads, shape=cost.shape)
    with tuner.timed(rows, context):       # the setting chosen and applied; the time learned after
        logits = model.forward_batch(parts)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

FIRST_PROBE = 2  # passes before the first probe of the other setting
AFTER_SWITCH = 8  # passes before the first probe after a switch
MAX_PROBE = 512  # the longest wait between probes
BACKOFF = 2  # a lost probe multiplies the wait before the next by this
BADLY_LOST = 2.0  # a probe that took this many times the current setting's time lost badly...
BADLY_LOST_BACKOFF = 4  # ...and multiplies the wait by this instead
SWITCH_GAIN = 0.1  # the other setting must be this much faster (log time) to switch
WEIGHT = 0.5  # the latest pass's weight in the current setting's running log time


class ThreadTuner:
    """Chooses between thread counts (`candidates`, the first one to start with) from the
    normalised time of the passes run on each; `apply(n)` sets n threads for the next pass (on
    the thread that runs it: torch's and numba's settings are per thread); `say` hears switches;
    `shape(rows, context)` is a pass's size (a cost curve's shape: passes of different sizes are
    compared by their time over it; none: every pass is of one size); `last` is the thread count
    of the last pass (what a pass's timing is tagged with where it is learned: core.cost).

    >>> tuner = ThreadTuner((2, 1))
    >>> for _ in range(40):  # two threads take 10 ms, one thread 4 ms (a busy machine)
    ...     t = tuner.before_pass()
    ...     tuner.after_pass(t, 0.010 if t == 2 else 0.004)
    >>> tuner.current
    1
    """

    def __init__(self, candidates: Sequence[int], apply: Callable[[int], None] = lambda n: None,
                 say: Callable[[str], None] = lambda message: None,
                 shape: Callable[[int, int], float] | None = None) -> None:
        self.candidates = [int(c) for c in dict.fromkeys(candidates)]
        self.apply, self.say, self.shape = apply, say, shape
        self.current = self.candidates[0]
        self.last: int | None = None
        self.switches = 0
        self._running: float | None = None  # log seconds of the current setting's recent passes
        self._since = 0  # passes on the current setting since the last probe or switch
        self._wait = FIRST_PROBE
        self._next_other = 0

    def before_pass(self) -> int:
        """The thread count for the next pass, applied."""
        threads = self.current
        if len(self.candidates) > 1 and self._running is not None and self._since >= self._wait:
            others = [c for c in self.candidates if c != self.current]
            threads = others[self._next_other % len(others)]
        self.apply(threads)
        self.last = threads
        return threads

    @contextmanager
    def timed(self, rows: int, context: int) -> Iterator[int]:
        """Run one pass over `rows` rows on a `context`-token cache inside: its thread count is
        chosen and applied before, its time (over `shape`) learned after; a pass that raises
        teaches nothing."""
        threads = self.before_pass()
        started = time.perf_counter()
        yield threads
        seconds = time.perf_counter() - started
        self.after_pass(threads, seconds / (self.shape(rows, context) if self.shape is not None else 1.0))

    def after_pass(self, threads: int, seconds: float) -> None:
        """Learn from a pass run on `threads` that took `seconds` (normalised for its size)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        y = math.log(seconds)
        if threads == self.current:
            self._running = y if self._running is None else self._running + WEIGHT * (y - self._running)
            self._since += 1
            return
        self._since = 0
        self._next_other += 1
        if self._running is not None and y < self._running - SWITCH_GAIN:
            self.say(f"threads: {threads} instead of {self.current} (a pass took {math.exp(y - self._running):.2f}x "
                     f"the time)")
            self.current, self._running, self._wait = threads, y, AFTER_SWITCH
            self.switches += 1
        else:
            badly = self._running is not None and y > self._running + math.log(BADLY_LOST)
            self._wait = min((BADLY_LOST_BACKOFF if badly else BACKOFF) * self._wait, MAX_PROBE)


def set_threads(n: int) -> None:
    """Run this thread's next passes on n threads: torch's and numba's (core.model.transformers.matmul)
    pools (a transformers model's; llama.cpp sets its own, core.model.llamacpp.LlamaModel.set_threads)."""
    import numba
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


def retune(tuner: ThreadTuner | None, threads: int, apply: Callable[[int], None],
           shape: Callable[[int, int], float] | None, say: Callable[[str], None] | None) -> ThreadTuner | None:
    """An engine's `tune_threads`: its tuner, made between `threads` and one the first time (None
    where threads is one), given `shape` and `say` (None: the ones it has kept)."""
    if tuner is None and threads > 1:
        tuner = ThreadTuner((threads, 1), apply)
    if tuner is not None:
        tuner.shape = shape if shape is not None else tuner.shape
        tuner.say = say if say is not None else tuner.say
    return tuner


def last_threads(tuner: ThreadTuner | None) -> int | None:
    """The thread count of the last pass `tuner` chose (None where the engine tunes no threads)."""
    return tuner.last if tuner is not None else None


def timed(tuner: ThreadTuner | None, rows: int, context: int) -> Any:
    """`tuner.timed(rows, context)`, or nothing to do where the engine tunes no threads (None)."""
    return tuner.timed(rows, context) if tuner is not None else nullcontext()
