"""Predicting what `specx replay` measures from a sample of the calls, and the speedup it means.

**Sampled replay with exact history.** A model-free replay (core.predict.replay.replay) carries one thing
from a call to the next: the drafter's global index, which learns each finished output. So what
call i measures in a full replay (tokens, steps, drafted, accepted) depends only on its prompt,
its output and the outputs of the calls before it. `replay_sample` indexes every output once, in
stored order, and replays only the sampled calls, each drafting from the head of that index that
holds the outputs before it (SuffixIndex.head: no sort), with learning held back: each sampled
call's figures are exactly those of the full replay. Prompt lookup keeps nothing across calls,
so it is exact call by call too.

**From the sample to the whole selection** (core/predict/sampling.py). The draws are systematic (`systematic_sample`: points
evenly spaced, from a seeded random start, along the calls in stored order, so the learning curve
is covered from start to end), each call's chance proportional to the square root of its output
length by default (`draw_sample`; or the same for every call). The selection's tokens per step,
total tokens / total steps, is estimated by the ratio estimator over the draws, each weighted by
1 / its chance (`ratio_estimate`, Cochran's standard error; with the finite-population
correction when every call was equally likely, without it, conservatively, when calls were
drawn by length). The interval reported is value +- 1.96 standard errors. A selection no larger
than the sample is replayed whole: exact figures, an interval of zero width.

**From tokens per step to speedup.** A cost curve gives the relative cost of one verification pass
over k tokens (core/predict/curves.py's `CostCurve`, k -> cost, linear in between and beyond the
last two points, as core.cost.forward.ForwardCost is). Plain decoding pays cost(1) per output token;
speculation pays cost(1 + draft size) per step. On a curve that is not flat, each draft is first cut
to the size that pays (core.cost.sizing.size_draft, as `generate` cuts it, its acceptance model
starting afresh in each call so that a call's figures stay independent of the others'); on a flat
one every draft node is free and nothing is cut. Projected speedup over plain decoding: sum of plain
decoding's costs / sum of the passes' costs; over prompt lookup: prompt lookup's passes / specx's,
both replayed (and cut) on the same calls.

This module takes token arrays, group keys and drafter factories; it reads no store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..decode.loop import DecodeStats
from .curves import CostCurve, PredictError
from .replay import replay_call
from .sampling import RatioEstimate, Sample, combined_ratio, ratio_estimate

UNSAID_DRAFT = 32  # a drafter's largest draft when it does not say (SuffixDrafter's max_spec_tokens default)


# ------------------------------------------------------------------------------------ sampled replay


@dataclass
class SampledCall:
    """One replayed call: its place in the stored order, group, the output tokens the global index
    held when it started, specx's figures as the full replay measures them (None when not asked),
    and per cost curve (plain decoding's cost, specx's passes, prompt lookup's passes)."""

    index: int
    group: str
    history_tokens: int
    stats: DecodeStats | None
    costs: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    prompt_lookup_steps: int | None = None


def replay_sample(outputs: Sequence[np.ndarray], groups: Sequence[str], sample: Sequence[int],
                  prompts: Sequence[np.ndarray], make_specx: Callable[[], Any], *,
                  make_prompt_lookup: Callable[[], Any] | None = None, curves: Sequence[CostCurve] = (),
                  warm: Sequence[np.ndarray] = (), unsized: bool = True,
                  specx_steps: Sequence[int] | None = None, lookup_steps: Sequence[int] | None = None,
                  prefill: Sequence[float] | None = None, on_call: Callable[[], None] = lambda: None) -> list[SampledCall]:
    """Replay the calls at `sample` (sorted positions in `outputs`, the selection's output tokens in
    stored order; `prompts[j]` is call sample[j]'s prompt) with the history the full replay gives
    them: every output before a call is in the global index when it starts (after `warm`, outputs
    learned first, as `replay --warm` does).

    `unsized`: replay specx as `specx replay` does (SampledCall.stats). Per curve, specx and prompt
    lookup are replayed with drafts cut to what pays (`size_draft`); on a curve flat up to the
    longest pass nothing is cut and every pass costs cost(1): their uncut steps are enough, taken
    from `specx_steps` / `lookup_steps` (per call of `outputs`, from a replay already run) or
    replayed. `make_prompt_lookup` None: no prompt lookup (its cost is then 0). `prefill[j]`: what
    call sample[j]'s prefill costs (the prompt tokens a prefix cache does not hold), in one-token
    passes, added to every method's cost on each curve (None: decoding only). `on_call` after each
    replayed call.
    """
    if len(prompts) != len(sample):
        raise PredictError(f"{len(prompts)} prompts for {len(sample)} sampled calls")
    if list(sample) != sorted(set(sample)) or (len(sample) and not 0 <= sample[0] <= sample[-1] < len(outputs)):
        raise PredictError("the sample must be distinct positions of the calls, in order")
    specx = make_specx()
    lookup = make_prompt_lookup() if make_prompt_lookup is not None else None
    longest = 1 + int(getattr(specx, "max_spec_tokens", UNSAID_DRAFT))
    if lookup is not None:
        longest = max(longest, 1 + int(getattr(lookup, "max_spec_tokens", UNSAID_DRAFT)))
    flat = {c.name: c.flat(longest) for c in curves}
    any_flat = any(flat.values())
    index = specx.global_index
    keep_history = unsized or (any_flat and specx_steps is None) or not all(flat.values())
    # What the full replay's finish_request adds: each non-empty output, oldest first. Without a
    # byte budget, all of them go into one index at once (one sort) and each sampled call drafts
    # from its head, the outputs before it (SuffixIndex.head: the suffix arrays filtered, no
    # sort). With a budget, eviction depends on when outputs arrive: one at a time, as the replay.
    at_once = index.budget_bytes is None
    if keep_history and at_once:
        index.add_many([tokens for tokens in (*warm, *outputs) if len(tokens)])
    learned = 0  # outputs the full replay's global index holds by now

    def learn(tokens: np.ndarray) -> None:
        nonlocal learned
        if keep_history and len(tokens):
            if not at_once:
                index.add(tokens)
            learned += 1

    history = 0
    for tokens in warm:  # as run_replay's warm-up
        learn(tokens)
        history += len(tokens)
    wanted = {position: j for j, position in enumerate(sample)}  # prompts[j] is read when call j comes up
    prefilled = dict(zip(sample, prefill)) if prefill is not None else {}
    out: list[SampledCall] = []
    for i, tokens in enumerate(outputs):
        j = wanted.get(i)
        if j is not None:
            prompt = prompts[j]
            if keep_history and at_once:
                specx.global_index = index.head(learned)
            call = SampledCall(i, groups[i], history, None)
            steps = specx_steps[i] if specx_steps is not None else None
            if unsized or (any_flat and steps is None):
                call.stats = replay_call(specx, prompt, tokens, learn=False)
                steps = call.stats.steps
            other_steps = lookup_steps[i] if lookup_steps is not None else None
            if lookup is not None and any_flat and other_steps is None:
                other_steps = replay_call(lookup, prompt, tokens).steps
            call.prompt_lookup_steps = other_steps
            for curve in curves:
                plain = len(tokens) * curve(1)
                if flat[curve.name]:
                    passes = steps * curve(1)
                    other = other_steps * curve(1) if lookup is not None else 0.0
                else:
                    passes = replay_call(specx, prompt, tokens, learn=False, cost=curve, size=True).pass_seconds
                    other = replay_call(lookup, prompt, tokens, cost=curve, size=True).pass_seconds \
                        if lookup is not None else 0.0
                first = prefilled.get(i, 0.0) * curve(1)  # the same for every method
                call.costs[curve.name] = (first + plain, first + passes, first + other if lookup is not None else 0.0)
            if not unsized:
                call.stats = None
            out.append(call)
            on_call()
        learn(tokens)  # what finish_request(learn=True) adds: the rebuilt output, equal to the recording
        history += len(tokens)
    return out


# -------------------------------------------------------------------------------------- the estimate


@dataclass
class Prediction:
    """Predicted figures of one group (or overall) from its sampled calls."""

    calls: int  # in the selection (or group)
    sample_calls: int  # distinct calls replayed
    tokens_per_step: RatioEstimate
    speedup: dict[str, dict[str, RatioEstimate]]  # curve -> {"vs_plain", "vs_prompt_lookup"}

    def to_json(self) -> dict[str, Any]:
        tps = self.tokens_per_step
        return {
            "sample_calls": self.sample_calls,
            "predicted_tokens_per_step": tps.value,
            "predicted_tokens_per_step_low": tps.low,
            "predicted_tokens_per_step_high": tps.high,
            "predicted_speedup": {name: {k: e.value for k, e in by.items()}
                                  | {f"{k}_{end}": getattr(e, end) for k, e in by.items() for end in ("low", "high")}
                                  for name, by in self.speedup.items()},
        }


Estimator = Callable[[Callable[[SampledCall], float], Callable[[SampledCall], float]], RatioEstimate]


def _figures(hits: Sequence[SampledCall], estimate: Estimator, curves: Sequence[str],
             prompt_lookup: bool) -> tuple[RatioEstimate, dict[str, dict[str, RatioEstimate]]]:
    """Tokens per step and the speedups per curve, each a ratio `estimate(y, x)` over the draws."""
    if all(c.stats is not None for c in hits):
        tps = estimate(lambda c: c.stats.tokens, lambda c: c.stats.steps)
    else:
        tps = RatioEstimate(None, None, len(hits), None)
    speedup = {}
    for name in curves:
        by = {"vs_plain": estimate(lambda c: c.costs[name][0], lambda c: c.costs[name][1])}
        if prompt_lookup:
            by["vs_prompt_lookup"] = estimate(lambda c: c.costs[name][2], lambda c: c.costs[name][1])
        speedup[name] = by
    return tps, speedup


def predict(sample: Sample, replayed: Mapping[int, SampledCall], calls: int, curves: Sequence[str] = (),
            prompt_lookup: bool = True) -> Prediction:
    """Ratio estimates over one sample's draws (`calls`: how many calls it was drawn from), from the
    replayed calls by position."""
    hits = [(replayed[i], w) for i, w in zip(sample.hits, sample.weights)]
    population = len(hits) if sample.exhaustive else None if sample.population is None else calls

    def estimate(y: Callable[[SampledCall], float], x: Callable[[SampledCall], float]) -> RatioEstimate:
        return ratio_estimate([w * y(c) for c, w in hits], [w * x(c) for c, w in hits], population)

    tps, speedup = _figures([c for c, _ in hits], estimate, curves, prompt_lookup)
    return Prediction(calls, len({c.index for c, _ in hits}), tps, speedup)


def predict_groups(samples: Mapping[str, Sample], replayed: Sequence[SampledCall], group_sizes: Mapping[str, int],
                   curves: Sequence[str] = (), prompt_lookup: bool = True) -> tuple[Prediction, dict[str, Prediction]]:
    """(overall, {group: prediction}) from a sample drawn within each group (`draw_stratified`):
    each group's figures from its own draws, the overall ones by the combined ratio estimator
    (exact, an interval of zero width, when every group was replayed whole)."""
    by_index = {c.index: c for c in replayed}
    groups = {key: predict(samples[key], by_index, size, curves, prompt_lookup) for key, size in group_sizes.items()}

    def combined(y: Callable[[SampledCall], float], x: Callable[[SampledCall], float]) -> RatioEstimate:
        return combined_ratio([([w * y(by_index[i]) for i, w in zip(part.hits, part.weights)],
                                [w * x(by_index[i]) for i, w in zip(part.hits, part.weights)],
                                None if part.population is None else group_sizes[key], part.exhaustive)
                               for key, part in samples.items()])

    hits = [by_index[i] for part in samples.values() for i in part.hits]
    tps, speedup = _figures(hits, combined, curves, prompt_lookup)
    overall = Prediction(sum(group_sizes.values()), len({c.index for c in hits}), tps, speedup)
    return overall, groups


def projected_speedup(sampled: Sequence[SampledCall], curves: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """{curve: {"vs_plain", "vs_prompt_lookup"}} over every call given (a full replay's projection:
    sums, no estimate)."""
    out = {}
    for name in curves:
        plain = sum(c.costs[name][0] for c in sampled)
        passes = sum(c.costs[name][1] for c in sampled)
        other = sum(c.costs[name][2] for c in sampled)
        out[name] = {"vs_plain": plain / passes if passes else None,
                     "vs_prompt_lookup": other / passes if passes and other else None}
    return out


def learning_curve(sampled: Sequence[SampledCall], sample: Sample | Mapping[str, Sample],
                   window: int = 20) -> list[tuple[int, float]]:
    """(history tokens, tokens per step over the `window` sampled calls ending there) along the
    stored order, each call weighted as the estimate weighs it: how tokens per step grows with the
    output tokens the global index holds.

    >>> calls = [SampledCall(i, "g", 100 * i, DecodeStats(calls=1, tokens=6, steps=s)) for i, s in enumerate((3, 2))]
    >>> learning_curve(calls, Sample((0, 1), (1.0, 1.0), 2), window=2)  # 6/3, then 12/5
    [(0, 2.0), (100, 2.4)]
    """
    weight: dict[int, float] = {}
    for part in sample.values() if isinstance(sample, Mapping) else [sample]:
        for i, w in zip(part.hits, part.weights):
            weight[i] = weight.get(i, 0.0) + w
    rows = [c for c in sampled if c.stats is not None]
    out = []
    for j in range(len(rows)):
        part = rows[max(0, j - window + 1) : j + 1]
        steps = sum(weight[c.index] * c.stats.steps for c in part)
        if steps:
            out.append((rows[j].history_tokens, sum(weight[c.index] * c.stats.tokens for c in part) / steps))
    return out
