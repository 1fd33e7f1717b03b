"""Model-free replay: the simulated verifier of DESIGN.md section 1.

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

With a cost curve (`cost`, a core.cost.ForwardCost: seconds of one verification pass over n
tokens), the replay also times itself as a device with that curve would: each step costs
cost(1 + draft size), plain decoding cost(1) per token, and (with `size`) each draft is first
cut as `generate` cuts it (size_draft with the running AcceptanceModel). That predicts the
speedup of a decoding method on hardware whose curve is known, or a curve's shape that does not
exist yet (examples/cost_bound.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from .cost import AcceptanceModel, ForwardCost, size_draft
from .speculate import Drafter


class ReplayMismatch(RuntimeError):
    """The replay did not rebuild a recorded output: a bug in drafting or acceptance, never the data."""


@dataclass
class ReplayStats:
    """Totals over replayed calls; `to_json` gives the reported figures."""

    calls: int = 0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0  # draft tokens accepted (bonus tokens not included)
    drafted: int = 0  # draft tokens proposed
    draft_seconds: float = 0.0  # speculate calls
    update_seconds: float = 0.0  # index updates: request start, appends, learning the output
    pass_seconds: float = 0.0  # with a cost curve: the verification passes' simulated time
    plain_seconds: float = 0.0  # with a cost curve: plain decoding's (one pass per output token)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted length -> steps

    def add(self, other: "ReplayStats") -> None:
        self.calls += other.calls
        self.tokens += other.tokens
        self.steps += other.steps
        self.accepted += other.accepted
        self.drafted += other.drafted
        self.draft_seconds += other.draft_seconds
        self.update_seconds += other.update_seconds
        self.pass_seconds += other.pass_seconds
        self.plain_seconds += other.plain_seconds
        self.accepted_hist.update(other.accepted_hist)

    def to_json(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        simulated = {"simulated_seconds": self.pass_seconds, "simulated_plain_seconds": self.plain_seconds,
                     "simulated_speedup": self.plain_seconds / self.pass_seconds} if self.pass_seconds else {}
        return simulated | {
            "calls": self.calls,
            "output_tokens": self.tokens,
            "steps": self.steps,
            "tokens_per_step": self.tokens / steps,
            "accepted_per_step": self.accepted / steps,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_draft_size": self.drafted / steps,
            "draft_us_per_token": 1e6 * self.draft_seconds / max(self.tokens, 1),
            "update_us_per_token": 1e6 * self.update_seconds / max(self.tokens, 1),
        }


def replay_call(drafter: Drafter, prompt: np.ndarray, output: np.ndarray, learn: bool = True,
                trace: list[tuple[int, int]] | None = None, cost: ForwardCost | None = None, size: bool = True,
                acceptance: AcceptanceModel | None = None) -> ReplayStats:
    """Replay one recorded output through `drafter`; raises ReplayMismatch if it is not rebuilt.

    With `trace`, (draft size, accepted) of every step is appended to it. With `cost`, the steps
    are timed by that curve (pass_seconds, plain_seconds) and, if `size`, drafts are cut to the
    size that pays, learning `acceptance` (pass one to carry it across calls) as `generate` does.
    """
    if acceptance is None:
        acceptance = AcceptanceModel()
    stats = ReplayStats(calls=1, tokens=len(output))
    out = output.tolist()
    rebuilt: list[int] = []
    clock = time.perf_counter
    t0 = clock()
    drafter.start_request(prompt)
    updating = clock() - t0
    drafting = 0.0
    pos = 0
    while pos < len(out):
        t0 = clock()
        draft = drafter.speculate()
        drafting += clock() - t0
        context = len(prompt) + pos
        if cost is not None and size:
            draft = size_draft(draft, cost, 1, acceptance, context=context)
        nodes = draft.accepted_nodes(out[pos : pos + len(draft)])
        path = [draft.token_ids[i] for i in nodes]
        step = path + out[pos + len(path) : pos + len(path) + 1]  # + the bonus token, if the output goes on
        if cost is not None:
            stats.pass_seconds += cost(1 + len(draft), context)
            stats.plain_seconds += sum(cost(1, context + i) for i in range(len(step)))
            if len(draft):
                acceptance.update(draft, nodes)
        rebuilt.extend(step)
        t0 = clock()
        drafter.extend(step)
        updating += clock() - t0
        pos += len(step)
        stats.steps += 1
        stats.accepted += len(path)
        stats.drafted += len(draft)
        stats.accepted_hist[len(path)] += 1
        if trace is not None:
            trace.append((len(draft), len(path)))
    t0 = clock()
    drafter.finish_request(learn=learn)
    stats.update_seconds = updating + clock() - t0
    stats.draft_seconds = drafting
    if rebuilt != out:
        first = next((i for i, (a, b) in enumerate(zip(rebuilt, out)) if a != b), min(len(rebuilt), len(out)))
        raise ReplayMismatch(f"replay rebuilt a different output (first difference at token {first})")
    return stats


@dataclass
class ReplayResult:
    overall: ReplayStats
    groups: dict[str, ReplayStats]
    curve: list[tuple[int, int]]  # per call, in order: (tokens, steps)


def replay(calls: Iterable[tuple[str, np.ndarray, np.ndarray]], drafter: Drafter,
           on_call: Callable[[], None] = lambda: None) -> ReplayResult:
    """Replay (group key, prompt tokens, output tokens) in order; each output is learned after its call."""
    overall = ReplayStats()
    groups: dict[str, ReplayStats] = {}
    curve = []
    for key, prompt, output in calls:
        stats = replay_call(drafter, prompt, output)
        overall.add(stats)
        groups.setdefault(key, ReplayStats()).add(stats)
        curve.append((stats.tokens, stats.steps))
        on_call()
    return ReplayResult(overall, groups, curve)
