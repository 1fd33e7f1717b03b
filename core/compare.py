"""Decoding methods side by side on the same prompts: plain greedy, transformers' prompt lookup and
specx, each output checked against plain decoding's.

The methods take turns prompt by prompt (plain, then prompt lookup, then specx on prompt 1, then
on prompt 2, ...), so a machine that slows down or speeds up during the run weighs on all of them
alike. specx's drafter keeps its global index across prompts: every output it produces enters
the index at once, as when serving.

    runs = compare(model, prompts, drafter, max_new_tokens=64, eos_token_id=tok.eos_token_id)
    summary(runs)["methods"]["specx"]["speedup_vs_plain"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cost import AcceptanceCalibration, ForwardCost
from .generate import generate
from .kernels import new_cache

METHODS = ("plain", "prompt_lookup", "specx")
STOCK = "stock_plain"  # optional: plain decoding on a model without core.kernels (pass stock_model)
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value (and vLLM's n-gram default range)


@dataclass
class MethodRun:
    """One method's outputs and totals over the timed prompts."""

    outputs: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # forward passes (specx only)
    accepted: int = 0  # draft tokens accepted (specx only)
    drafted: int = 0


def hf_generate(model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None,
                prompt_lookup_num_tokens: int | None = None, stock_cache: bool = False) -> list[int]:
    """Greedy decoding by transformers' own `generate` (with its prompt lookup when asked), on the
    same KV cache class as specx (core.kernels.new_cache), so that only the decoding differs;
    `stock_cache`: on transformers' default cache instead."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    if not stock_cache:
        extra["past_key_values"] = new_cache(model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos_token_id, pad_token_id=eos_token_id, **extra)
    return out[0, ids.shape[1] :].tolist()


def compare(model: Any, prompts: Sequence[Sequence[int]], drafter: Any, max_new_tokens: int,
            eos_token_id: int | None, methods: Sequence[str] = METHODS, cost: ForwardCost | None = None,
            timed: Callable[[int], bool] = lambda i: True, on_call: Callable[[], None] = lambda: None,
            prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS, stock_model: Any = None) -> dict[str, MethodRun]:
    """Run every method on every prompt (greedy); totals count only prompts where `timed(i)`.
    STOCK runs plain decoding on `stock_model` (the same weights loaded without core.kernels)."""
    unknown = [m for m in methods if m not in (*METHODS, STOCK)]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join((*METHODS, STOCK))}")
    if STOCK in methods and stock_model is None:
        raise ValueError(f"method {STOCK} needs stock_model")
    runs = {m: MethodRun() for m in methods}
    calibration = AcceptanceCalibration()  # how far the drafts' scores are to be trusted, learned across prompts
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            for method in methods:
                run = runs[method]
                steps = accepted = drafted = 0
                t0 = time.perf_counter()
                if method == "specx":
                    out = []
                    for step in generate(model, prompt, drafter, max_new_tokens=max_new_tokens,
                                         eos_token_ids=eos_token_id, cost=cost, calibration=calibration):
                        out += step.new_tokens
                        steps += 1
                        accepted += step.accepted
                        drafted += step.draft_size
                elif method == STOCK:
                    out = hf_generate(stock_model, prompt, max_new_tokens, eos_token_id, stock_cache=True)
                else:
                    out = hf_generate(model, prompt, max_new_tokens, eos_token_id,
                                      prompt_lookup_tokens if method == "prompt_lookup" else None)
                elapsed = time.perf_counter() - t0
                run.outputs.append(out)
                if timed(i):
                    run.tokens += len(out)
                    run.seconds += elapsed
                    run.steps += steps
                    run.accepted += accepted
                    run.drafted += drafted
                on_call()
    return runs


def summary(runs: dict[str, MethodRun], timed: Callable[[int], bool] = lambda i: True) -> dict[str, Any]:
    """{"methods": {name: {tokens_per_s, tokens, seconds, identical_calls, calls, speedup_vs_plain, ...}}}.

    identical_calls counts the timed prompts whose output equals plain decoding's token for token.
    """
    reference = runs["plain"].outputs if "plain" in runs else None
    methods: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        idx = [i for i in range(len(run.outputs)) if timed(i)]
        row: dict[str, Any] = {
            "tokens_per_s": run.tokens / run.seconds if run.seconds else 0.0,
            "tokens": run.tokens, "seconds": run.seconds, "calls": len(idx),
            "identical_calls": None if reference is None else sum(run.outputs[i] == reference[i] for i in idx),
        }
        if name == "specx":
            row |= {"steps": run.steps, "tokens_per_step": run.tokens / run.steps if run.steps else 0.0,
                    "accepted_per_step": run.accepted / run.steps if run.steps else 0.0,
                    "drafted_per_step": run.drafted / run.steps if run.steps else 0.0}
        methods[name] = row
    for name, row in methods.items():
        for base in ("plain", "prompt_lookup"):
            if base in methods and base != name and methods[base]["tokens_per_s"]:
                row[f"speedup_vs_{base}"] = row["tokens_per_s"] / methods[base]["tokens_per_s"]
    return {"methods": methods}
