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

    tuner = ThreadTuner((2, 1), apply=set_threads)   # an engine's thread_tuner() makes one
    threads = tuner.before_pass()          # the setting to run the next pass on (applied)
    tuner.after_pass(threads, seconds)     # seconds normalised by the pass's size
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

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
    the thread that runs it: torch's and numba's settings are per thread); `say` hears switches.

    >>> tuner = ThreadTuner((2, 1))
    >>> for _ in range(40):  # two threads take 10 ms, one thread 4 ms (a busy machine)
    ...     t = tuner.before_pass()
    ...     tuner.after_pass(t, 0.010 if t == 2 else 0.004)
    >>> tuner.current
    1
    """

    def __init__(self, candidates: Sequence[int], apply: Callable[[int], None] = lambda n: None,
                 say: Callable[[str], None] = lambda message: None) -> None:
        self.candidates = [int(c) for c in dict.fromkeys(candidates)]
        self.apply, self.say = apply, say
        self.current = self.candidates[0]
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
        return threads

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
