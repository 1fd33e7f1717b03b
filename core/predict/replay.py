"""Model-free replay: the simulated verifier of docs/design.md, "The method" (core.decode.verifiers.recorded).

Replay a recorded output as if the model were producing it: at each step draft from the indexes,
accept the longest draft path equal to the recorded continuation, add one bonus token (what the
model's own prediction would be), append, repeat. The output is rebuilt from the accepted draft
tokens and the bonus tokens, and must equal the recording: a mismatch raises ReplayMismatch.

Hand-worked (defaults: max_spec_factor 1, so a match of p tokens drafts at most p): the global
index holds [7, 8, 9]; prompt [1]; recorded output [7, 8, 9, 5].
  step 1: context [1]: no match, empty draft; accept 0, bonus 7            -> [7]
  step 2: context ends [7]: p = 1, draft [8]; accept 1, bonus 9            -> [7, 8, 9]
  step 3: context ends [7, 8, 9]: the indexed sequence ends there: empty   -> [7, 8, 9, 5]
three steps for four tokens: 1.33 tokens per step, 1 of 1 drafted tokens accepted.

With a cost curve (`cost`, a core.cost.forward.ForwardCost: seconds of one verification pass over n
tokens), the replay also times itself as a device with that curve would: each step costs
cost(1 + draft size), plain decoding cost(1) per token, and (with `size`) each draft is first
cut as `generate` cuts it (size_draft with the running AcceptanceModel). That predicts the
speedup of a decoding method on hardware whose curve is known, or a curve's shape that does not
exist yet (examples/cost_bound.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cost.acceptance import AcceptanceModel
from ..cost.forward import ForwardCost
from ..decode.loop import DecodeStats, Decoded, Step, collect, decode
from ..decode.speculate import Drafter
from ..decode.verifiers.recorded import RecordedVerifier, ReplayMismatch


class _Timed:
    """A drafter whose request start and finish are timed (speculate and extend go straight
    through: the decode loop times them)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.seconds = drafter, 0.0
        self.speculate, self.extend = drafter.speculate, drafter.extend

    def start_request(self, prompt: Any) -> None:
        t0 = time.perf_counter()
        self.drafter.start_request(prompt)
        self.seconds += time.perf_counter() - t0

    def finish_request(self, learn: bool = True) -> None:
        t0 = time.perf_counter()
        self.drafter.finish_request(learn)
        self.seconds += time.perf_counter() - t0


def replay_call(drafter: Drafter, prompt: np.ndarray, output: np.ndarray, *, learn: bool = True,
                trace: list[tuple[int, int]] | None = None, cost: ForwardCost | None = None, size: bool = True,
                acceptance: AcceptanceModel | None = None) -> DecodeStats:
    """Replay one recorded output through `drafter` (core.decode.loop.decode with a RecordedVerifier);
    raises ReplayMismatch if it is not rebuilt.

    With `trace`, (draft size, accepted) of every step is appended to it. With `cost`, the steps
    are timed by that curve (pass_seconds, plain_seconds) and, if `size`, drafts are cut to the
    size that pays, learning `acceptance` (pass one to carry it across calls) as `generate` does.
    """
    out = output.tolist()
    timed = _Timed(drafter)
    context = len(prompt)

    def simulate(step: Step, run: Decoded) -> None:
        nonlocal context
        if cost is not None:
            run.stats.pass_seconds += cost(1 + step.draft_size, context)
            run.stats.plain_seconds += sum(cost(1, context + i) for i in range(len(step.new_tokens)))
        context += len(step.new_tokens)
        if trace is not None:
            trace.append((step.draft_size, step.accepted))

    run = collect(decode(RecordedVerifier(out), prompt, timed, cost=cost if size else None, acceptance=acceptance,
                         learn=learn), simulate)
    assert run is not None  # `simulate` never stops it
    stats = run.stats
    stats.update_seconds += timed.seconds
    if stats.tokens != len(out):
        raise ReplayMismatch(f"replay rebuilt {stats.tokens} tokens of a {len(out)}-token recording")
    return stats


@dataclass
class ReplayResult:
    overall: DecodeStats
    groups: dict[str, DecodeStats]
    curve: list[tuple[int, int]]  # per call, in order: (tokens, steps)


def replay(calls: Iterable[tuple[str, np.ndarray, np.ndarray]], drafter: Drafter,
           on_call: Callable[[], None] = lambda: None) -> ReplayResult:
    """Replay (group key, prompt tokens, output tokens) in order; each output is learned after its call."""
    overall = DecodeStats()
    groups: dict[str, DecodeStats] = {}
    curve = []
    for key, prompt, output in calls:
        stats = replay_call(drafter, prompt, output)
        overall.add(stats)
        groups.setdefault(key, DecodeStats()).add(stats)
        curve.append((stats.tokens, stats.steps))
        on_call()
    return ReplayResult(overall, groups, curve)
