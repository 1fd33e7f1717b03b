"""Whether other processes took the cores while a trial ran: a trial they disturbed is not kept.

A trial (core.predict.engines) compares engines by wall-clock time. A second trial, a build or a
busy server beside it takes cores from whichever method runs at that moment, and the figures then
say more about the neighbour than about the engines (issue 47: beside a second trial, one recorded
specx on llama.cpp at 1.91x llama.cpp plain, where undisturbed runs give 0.88-0.92x). Linux counts
every core's busy time in /proc/stat, and this process's own (all its threads: the trial runs
every engine in this process) in os.times(): over the trial, the difference is what the others
used, and as a share of the cores' time it says whether the trial was disturbed.

    before = sample()
    ...                                   # the trial
    share = others_share(before, sample())  # 0.46: others held 46% of the cores; None: cannot tell
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

DISTURBED_SHARE = 0.25  # others holding more than this share of the cores' time disturbed the trial
_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuSample:
    """The machine's busy CPU seconds (all cores), this process's own, and the wall clock."""

    busy_s: float
    own_s: float
    wall_s: float


def sample() -> CpuSample | None:
    """Now's CpuSample; None where the machine's busy time cannot be read (not Linux)."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
    values = [int(v) for v in fields[1:9]]
    busy = sum(values) - values[3] - (values[4] if len(values) > 4 else 0)
    times = os.times()
    return CpuSample(busy / ticks, times.user + times.system, time.monotonic())


def others_share(before: CpuSample | None, after: CpuSample | None, cores: int | None = None) -> float | None:
    """The share of the cores' time (0 to 1) that processes other than this one used between two
    samples; None when either is missing or no time passed.

    >>> others_share(CpuSample(100.0, 10.0, 0.0), CpuSample(112.0, 14.0, 4.0), cores=2)
    1.0
    >>> others_share(CpuSample(100.0, 10.0, 0.0), CpuSample(104.4, 14.0, 4.0), cores=2)
    0.05
    """
    if before is None or after is None or after.wall_s <= before.wall_s:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    capacity = (after.wall_s - before.wall_s) * (cores or os.cpu_count() or 1)
    return round(min(max(others / capacity, 0.0), 1.0), 3)
