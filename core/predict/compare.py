"""Decoding methods side by side on the same prompts: plain greedy, transformers' prompt lookup and
specx, each output checked against plain decoding's.

The methods take turns prompt by prompt (plain, then prompt lookup, then specx on prompt 1, then
on prompt 2, ...), so a machine that slows down or speeds up during the run weighs on all of them
alike. specx's drafter keeps its global index across prompts: every output it produces enters
the index at once, as when serving.

    runs = compare(model, prompts, drafter, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    summary(runs).methods["specx"].speedup_vs["plain"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from ..cost.acceptance import AcceptanceModel
from ..cost.forward import ForwardCost
from ..decode.generate import generate, thread_tuner
from ..decode.loop import DecodeStats, collect
from ..model.kv_cache import cache_kwarg, new_cache
from ..model.llamacpp import on_llamacpp
from ..model.prefix_cache import PrefixCache

METHODS = ("plain", "prompt_lookup", "specx")
STOCK = "stock_plain"  # optional: plain decoding on a model without core.model.kernels (pass stock_model)
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


def hf_generate(model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None,
                prompt_lookup_num_tokens: int | None = None, stock_cache: bool = False,
                prefix_cache: PrefixCache | None = None) -> list[int]:
    """Greedy decoding by transformers' own `generate` (with its prompt lookup when asked), on the
    same KV cache class as specx (core.model.kv_cache.new_cache), so that only the decoding differs;
    `stock_cache`: on transformers' default cache instead. With `prefix_cache`, the prompt but its
    last token is prefilled through it first (transformers then runs only the last token)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    cache = DynamicCache() if stock_cache else new_cache(model)
    if prefix_cache is not None:
        cache = prefix_cache.prefill(model, prompt[:-1], cache)
    if prefix_cache is not None or not stock_cache:
        extra[cache_kwarg(model)] = cache
    if prompt_lookup_num_tokens and cache.get_seq_length():
        # transformers' assisted decoding runs its first pass over the whole prompt even when the
        # cache already holds all of it but the last token; run it over the uncached tokens only
        model.prepare_inputs_for_generation = partial(_uncached_first_pass, type(model).prepare_inputs_for_generation,
                                                      model)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id, **extra)
    finally:
        model.__dict__.pop("prepare_inputs_for_generation", None)
    return out[0, ids.shape[1] :].tolist()


def _uncached_first_pass(prepare: Callable[..., Any], model: Any, input_ids: torch.Tensor,
                         next_sequence_length: int | None = None, is_first_iteration: bool | None = False,
                         **kwargs: Any) -> Any:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.2x: `cache`
    if is_first_iteration and next_sequence_length is None and cache is not None:
        next_sequence_length = input_ids.shape[1] - cache.get_seq_length()
    return prepare(model, input_ids, next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration,
                   **kwargs)


def compare(model: Any, prompts: Sequence[Sequence[int]], drafter: Any, max_new_tokens: int,
            eos_token_id: int | None, methods: Sequence[str] = METHODS, cost: ForwardCost | None = None,
            timed: Callable[[int], bool] = lambda i: True, on_call: Callable[[], None] = lambda: None,
            prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS, stock_model: Any = None,
            prefix_cache_tokens: int = 0) -> dict[str, MethodRun]:
    """Run every method on every prompt (greedy); totals count only prompts where `timed(i)`.
    STOCK runs plain decoding on `stock_model` (the same weights loaded without core.model.kernels).
    `prefix_cache_tokens` > 0 gives every method a prefix cache of that many tokens (its own, so
    that each method's cached entries are computed as it would compute them)."""
    unknown = [m for m in methods if m not in (*METHODS, STOCK)]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join((*METHODS, STOCK))}")
    if STOCK in methods and stock_model is None:
        raise ValueError(f"method {STOCK} needs stock_model")
    runs = {m: MethodRun() for m in methods}
    llama = on_llamacpp(model)  # a core.model.llamacpp.LlamaModel: no prefix cache
    prefixes = {m: PrefixCache(prefix_cache_tokens) if prefix_cache_tokens and not llama else None for m in methods}
    acceptance = AcceptanceModel()  # what the drafts are worth, learned from the verdicts across prompts
    threads = thread_tuner(model)  # specx's passes choose the thread count; the other methods run on its choice
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            for method in methods:
                run = runs[method]
                totals = DecodeStats()
                t0 = time.perf_counter()
                prefilled = prefixes[method].seconds if prefixes[method] is not None else 0.0
                missed = prefixes[method].miss_tokens if prefixes[method] is not None else 0
                if llama:  # one KV sequence, shared by the methods: each call prefills its whole prompt
                    model.keep(0)
                if llama and method != "specx":
                    if method != "plain":
                        raise ValueError(f"method {method} runs on transformers; on llama.cpp: plain and specx")
                    from ..model.llamacpp import greedy

                    out = greedy(model, prompt, max_new_tokens, [] if eos_token_id is None else [eos_token_id])
                elif method == "specx":
                    decoded = collect(generate(model, prompt, drafter, max_new_tokens=max_new_tokens,
                                               eos_token_ids=eos_token_id, cost=cost, acceptance=acceptance,
                                               prefix_cache=prefixes[method], threads=threads))
                    assert decoded is not None
                    out, totals = decoded.tokens, decoded.stats
                elif method == STOCK:
                    out = hf_generate(stock_model, prompt, max_new_tokens, eos_token_id, stock_cache=True,
                                      prefix_cache=prefixes[method])
                else:
                    out = hf_generate(model, prompt, max_new_tokens, eos_token_id,
                                      prompt_lookup_tokens if method == "prompt_lookup" else None,
                                      prefix_cache=prefixes[method])
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
    steps: int | None = None  # specx only: its verification passes and what they carried
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
        if name == "specx":
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
