"""Decoding methods side by side on the same prompts: plain greedy, transformers' prompt lookup and
specx, each output checked against plain decoding's.

The methods take turns prompt by prompt (plain, then prompt lookup, then specx on prompt 1, then
on prompt 2, ...), so a machine that slows down or speeds up during the run weighs on all of them
alike. specx's drafter keeps its global index across prompts: every output it produces enters
the index at once, as when serving.

    runs = compare(engine, prompts, drafter, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    summary(runs).methods["specx"].speedup_vs["plain"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cost.acceptance import AcceptanceModel
from ..cost.forward import ForwardCost
from ..decode.generate import generate
from ..decode.loop import DecodeStats, collect
from ..decode.request import Decoding
from ..index.successors import SuccessorTable
from ..model.engine import Engine
from ..model.transformers.engine import hf_generate

METHODS = ("plain", "prompt_lookup", "specx")
DRAFTER_METHODS = {"suffix": "specx", "table": "specx_table", "hybrid": "specx_hybrid"}  # --drafter -> method name
# optional: plain decoding on a model without core.model.transformers.kernels (pass stock_model)
STOCK = "stock_plain"
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value (and vLLM's n-gram default range)


@dataclass
class MethodRun:
    """One method's outputs, and its totals over the timed prompts (`stats`: tokens for every
    method, steps, accepted and drafted for specx's)."""

    outputs: list[list[int]] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # of `seconds`, in the prefix cache's prefill (with prefix_cache_tokens > 0)
    prefill_tokens: int = 0  # prompt tokens prefilled (not found in the prefix cache)
    call_rates: list[float] = field(default_factory=list)  # tokens/s of each timed call past its prefill


@dataclass(frozen=True)
class Speculator:
    """A specx method of a comparison: its drafter and the successor table its passes teach (None:
    none; core.decode.hybrid.HybridDrafter drafts from one)."""

    drafter: Any
    successors: SuccessorTable | None = None


def compare(engine: Engine, prompts: Sequence[Sequence[int]], drafter: Any, *, max_new_tokens: int,
            eos_token_id: int | None, methods: Sequence[str] = METHODS, cost: ForwardCost | None = None,
            timed: Callable[[int], bool] = lambda i: True, on_call: Callable[[], None] = lambda: None,
            prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS, stock_model: Any = None,
            prefix_cache_tokens: int = 0, speculators: Mapping[str, Speculator] | None = None) -> dict[str, MethodRun]:
    """Run every method on every prompt (greedy); totals count only prompts where `timed(i)`.
    "plain" and "prompt_lookup" are the engine's own decoding (Engine.plain; prompt lookup where
    it runs, `engine.prompt_lookup`). STOCK runs plain decoding on `stock_model` (the same weights
    loaded without core.model.transformers.kernels, a transformers model). `prefix_cache_tokens` > 0
    gives every method a prefix cache of that many tokens where the engine takes one (its own, so
    that each method's cached entries are computed as it would compute them). `speculators` names more specx
    methods (e.g. "specx_hybrid"), each with its own drafter, successor table and acceptance model;
    "specx" is `drafter` unless `speculators` names it."""
    specx = {"specx": Speculator(drafter)} | dict(speculators or {})
    unknown = [m for m in methods if m not in (*METHODS, STOCK, *specx)]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join((*METHODS, STOCK, *specx))}")
    if STOCK in methods and stock_model is None:
        raise ValueError(f"method {STOCK} needs stock_model")
    if "prompt_lookup" in methods and not engine.prompt_lookup:
        raise ValueError(f"method prompt_lookup runs on transformers; on {engine.name}: plain and specx")
    runs = {m: MethodRun() for m in methods}
    prefixes = {m: engine.new_prefix_cache(prefix_cache_tokens) if prefix_cache_tokens else None for m in methods}
    acceptance = {m: AcceptanceModel() for m in specx}  # what the drafts are worth, learned across prompts
    engine.tune_threads(cost.shape if cost is not None else None)  # its passes choose their thread count
    settings = Decoding(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_id)  # greedy, as the other methods
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            for method in methods:
                run = runs[method]
                totals = DecodeStats()
                t0 = time.perf_counter()
                prefilled = prefixes[method].seconds if prefixes[method] is not None else 0.0
                missed = prefixes[method].miss_tokens if prefixes[method] is not None else 0
                engine.clear()  # what the engine keeps between requests is not shared by the methods
                if method in specx:
                    decoded = collect(generate(engine, prompt, specx[method].drafter, settings, cost=cost,
                                               acceptance=acceptance[method], prefix_cache=prefixes[method],
                                               successors=specx[method].successors))
                    assert decoded is not None
                    out, totals = decoded.tokens, decoded.stats
                elif method == STOCK:
                    out = hf_generate(stock_model, prompt, max_new_tokens, eos_token_id, stock_cache=True,
                                      prefix_cache=prefixes[method])
                else:
                    out = engine.plain(prompt, max_new_tokens, eos_token_id, prefix_cache=prefixes[method],
                                       lookup=prompt_lookup_tokens if method == "prompt_lookup" else None)
                elapsed = time.perf_counter() - t0
                run.outputs.append(out)
                if timed(i):
                    totals.calls, totals.tokens = 1, len(out)
                    run.stats.add(totals)
                    run.seconds += elapsed
                    prefill = 0.0
                    if prefixes[method] is not None:
                        prefill = prefixes[method].seconds - prefilled
                        run.prefill_seconds += prefill
                        run.prefill_tokens += prefixes[method].miss_tokens - missed
                    if elapsed > prefill and out:
                        run.call_rates.append(len(out) / (elapsed - prefill))
                on_call()
    return runs


def _decoding_seconds(row: MethodFigures) -> float | None:
    """Seconds past the prefix cache's prefills (None without one: the prefill is not timed apart)."""
    if not row.prefill_seconds:
        return None
    return row.seconds - row.prefill_seconds


@dataclass
class MethodFigures:
    """One method's figures over the timed prompts of a comparison (`summary`)."""

    tokens_per_s: float
    tokens: int
    seconds: float
    calls: int
    prefill_seconds: float
    prefill_tokens: int
    call_tokens_per_s: list[float]  # each timed call's tokens/s past its prefill
    identical_calls: int | None  # outputs equal to plain decoding's token for token (None: plain not run)
    speedup_vs: dict[str, float] = field(default_factory=dict)  # base method -> this one's tokens/s over its
    decode_speedup_vs: dict[str, float] = field(default_factory=dict)  # the same, past each prompt's prefill
    steps: int | None = None  # specx's methods only: their verification passes and what they carried
    tokens_per_step: float | None = None
    accepted_per_step: float | None = None
    drafted_per_step: float | None = None

    def to_json(self) -> dict[str, Any]:
        row = {k: v for k, v in self.__dict__.items() if k not in ("speedup_vs", "decode_speedup_vs")}
        row = {k: v for k, v in row.items() if v is not None or k == "identical_calls"}
        return row | {f"speedup_vs_{b}": v for b, v in self.speedup_vs.items()} | {
            f"decode_speedup_vs_{b}": v for b, v in self.decode_speedup_vs.items()}


@dataclass
class Comparison:
    """`summary`'s result: each method's figures; `steady` is False when plain decoding's calls
    spread so widely (`steady` on their middle half) that the machine was busy and the speedups are
    not stable figures; `busy` then says so in words."""

    methods: dict[str, MethodFigures]
    busy: str | None

    @property
    def steady(self) -> bool:
        return self.busy is None

    def to_json(self) -> dict[str, Any]:
        return {"methods": {name: row.to_json() for name, row in self.methods.items()}, "steady": self.steady,
                "busy": self.busy}


def summary(runs: dict[str, MethodRun], timed: Callable[[int], bool] = lambda i: True) -> Comparison:
    """Each method's figures over the prompts where `timed(i)`, speedups against plain decoding and
    prompt lookup when they ran, and whether the machine was steady enough to trust them."""
    reference = runs["plain"].outputs if "plain" in runs else None
    methods: dict[str, MethodFigures] = {}
    for name, run in runs.items():
        idx = [i for i in range(len(run.outputs)) if timed(i)]
        row = MethodFigures(run.stats.tokens / run.seconds if run.seconds else 0.0, run.stats.tokens, run.seconds,
                            len(idx), run.prefill_seconds, run.prefill_tokens, run.call_rates,
                            None if reference is None else sum(run.outputs[i] == reference[i] for i in idx))
        if run.stats.steps:  # a specx method: its verification passes
            st = run.stats
            row.steps, row.accepted_per_step = st.steps, st.accepted_per_step
            row.tokens_per_step = st.tokens / st.steps if st.steps else 0.0
            row.drafted_per_step = st.drafted / st.steps if st.steps else 0.0
        methods[name] = row
    for name, row in methods.items():
        for base in ("plain", "prompt_lookup"):
            if base not in methods or base == name:
                continue
            if methods[base].tokens_per_s:
                row.speedup_vs[base] = row.tokens_per_s / methods[base].tokens_per_s
            decoding, base_decoding = _decoding_seconds(row), _decoding_seconds(methods[base])
            if decoding and base_decoding:  # tokens per second spent past the prompt's prefill
                row.decode_speedup_vs[base] = (row.tokens / decoding) / (methods[base].tokens / base_decoding)
    plain = sorted(runs["plain"].call_rates) if "plain" in runs else []
    middle = plain[len(plain) // 4 : len(plain) - len(plain) // 4] or plain  # one slow call is not a busy machine
    busy = busy_note("plain decoding (the middle half of its calls)", middle)
    return Comparison(methods, busy)


STEADY_SPREAD = 1.3  # fastest / slowest of repeated runs of one method beyond this: the machine was busy


def steady(rates: Sequence[float]) -> bool:
    """Whether repeated runs of one method (tokens/s) agree well enough for a timed figure."""
    rates = [r for r in rates if r > 0]
    return len(rates) < 2 or max(rates) / min(rates) <= STEADY_SPREAD


def busy_note(method: str, rates: Sequence[float]) -> str | None:
    """A warning when repeated runs of `method` (tokens/s) disagree: the machine was busy and a
    speedup timed on it is not a stable figure (ratios of runs taken in turn still are, roughly)."""
    rates = [r for r in rates if r > 0]
    if steady(rates):
        return None
    return (f"the machine was busy: {method} ran at {min(rates):.1f} to {max(rates):.1f} tokens/s across its runs "
            f"({max(rates) / min(rates):.1f}x apart); the speedup above is not a stable figure: run again when it is "
            f"quieter, or compare more runs")
