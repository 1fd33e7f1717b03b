"""The decode loop: draft -> verify -> accept -> update, one Step per forward pass.

Plain decoding is the same loop with empty drafts (each step then emits exactly one token), so
the speculative and the plain path share every line that decides which token comes next.

    steps = generate(model, prompt_ids, SuffixDrafter(index), max_new_tokens=64, eos_token_ids=[2])
    output = [tok for step in steps for tok in step.new_tokens]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cost import AcceptanceModel, ForwardCost, size_draft, subtree
from .draft import MODEL, Draft
from .speculate import Drafter
from .verify import Sampling, check_draft, verify


@dataclass
class Step:
    """One verification pass: the tokens it emitted (accepted draft tokens + the bonus token, cut
    at EOS or max_new_tokens), the draft's size and how many of its nodes were accepted."""

    new_tokens: list[int]
    draft_size: int
    accepted: int
    draft_us: float  # time the drafter took to propose the draft
    verify_us: float  # forward pass + accept walk + cache pruning


@dataclass
class Totals:
    """What the steps of one decode add up to (callers stream the steps and `add` each)."""

    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0  # draft tokens accepted
    drafted: int = 0  # draft tokens verified
    draft_us: float = 0.0
    verify_us: float = 0.0

    def add(self, step: Step) -> None:
        self.tokens += step.new_tokens
        self.steps += 1
        self.accepted += step.accepted
        self.drafted += step.draft_size
        self.draft_us += step.draft_us
        self.verify_us += step.verify_us


def generate(model: Any, prompt_ids: Sequence[int], drafter: Drafter | None = None, max_new_tokens: int = 256,
             eos_token_ids: Iterable[int] | int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, cost: ForwardCost | None = None,
             stop: Callable[[list[int]], int | None] | None = None,
             acceptance: AcceptanceModel | None = None, prefix_cache: Any = None) -> Iterator[Step]:
    """Decode up to `max_new_tokens` after `prompt_ids`, yielding one Step per forward pass.

    `drafter` (optional; a core.speculate.Drafter) is driven through a request: start_request(prompt),
    speculate() before each pass, extend(tokens) after it, finish_request(learn). Greedy output
    (temperature 0) equals plain greedy decoding token for token; with temperature > 0 every token
    has exactly the plain sampler's distribution, and the same `seed` gives the same text with or
    without a drafter (up to floating-point differences between the two passes). With `cost`
    (a measured forward-pass cost curve), each draft is cut to the size that pays (see cost.py).
    `stop` (optional, e.g. a text.TextStream) sees each step's tokens and returns None to go on or
    how many of them to keep: decoding then ends there, as at EOS. `acceptance` carries what the
    verdicts taught about the drafts' worth across requests (a server or a benchmark passes one for
    all of them); by default each request starts afresh. `prefix_cache` (a core.prefix_cache.PrefixCache
    shared by the requests) skips the prefill of the prompt's longest prefix it has seen before.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: decoding needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or temperature < 0:
        raise ValueError("top_k and temperature must be >= 0")
    eos = _eos_set(eos_token_ids)
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    sampling = Sampling(float(temperature), int(top_k), float(top_p), generator)

    if drafter is not None:
        drafter.start_request(prompt)
    if acceptance is None:
        acceptance = AcceptanceModel()  # adaptive draft size: each node's chance, learned from verdicts
    learn = False
    try:
        cache = _prefill(model, prompt[:-1], prefix_cache)
        # The last prompt token stays pending: the first step's pass reads it together with the
        # first draft, so even the first output token can come with accepted draft tokens.
        pending = [prompt[-1]]
        num_out = 0
        guesses: list[int] = []  # the model's own guesses from the last pass (speculative decoding only)
        while num_out < max_new_tokens:
            start = time.perf_counter()
            draft = drafter.speculate() if drafter is not None else Draft()
            check_draft(draft, model.config.vocab_size)
            if guesses:
                draft = add_guesses(draft, guesses)
            # A step emits at most accepted + 1 tokens; deeper nodes would be computed for nothing.
            draft = limit_depth(draft, max_new_tokens - num_out - 1)
            if cost is not None:
                draft = size_draft(draft, cost, len(pending), acceptance, context=len(prompt) + num_out)
            drafted = time.perf_counter()
            verdict = verify(model, cache, pending, draft, sampling)
            verified = time.perf_counter()
            tokens = verdict.tokens[: max_new_tokens - num_out]
            done = False
            for i, tok in enumerate(tokens):
                if tok in eos:  # the model stopped: nothing after EOS is output, drafted or not
                    tokens, done = tokens[: i + 1], True
                    break
            if stop is not None:
                keep = stop(tokens)
                if keep is not None:
                    tokens, done = tokens[:keep], True
            num_out += len(tokens)
            if len(draft):
                acceptance.update(draft, verdict.accepted_nodes)
            if drafter is not None:
                drafter.extend(tokens)
            yield Step(tokens, len(draft), min(verdict.num_accepted, len(tokens)),
                       (drafted - start) * 1e6, (verified - drafted) * 1e6)
            if done:
                break
            pending = [tokens[-1]]
            guesses = verdict.guesses if drafter is not None else []
        learn = True
    finally:
        if drafter is not None:
            drafter.finish_request(learn)


GUESS_PROB = 0.5  # a guess's D before the acceptance model has seen guesses verified


def add_guesses(draft: Draft, guesses: Sequence[int]) -> Draft:
    """The draft with the model's guesses (core.verify.Verdict.guesses) as extra roots, tagged MODEL;
    a root the drafter proposed too keeps its place and gains the MODEL bit.

    >>> add_guesses(Draft([5, 6], [-1, 0], [0.9, 0.5], 1.4, 2).tagged(1), [5, 8]).sources
    [5, 1, 4]
    """
    guess = Draft(list(guesses), [-1] * len(guesses), [GUESS_PROB] * len(guesses), GUESS_PROB * len(guesses), 1)
    return draft.merge(guess.tagged(MODEL), len(draft) + len(guesses))


def limit_depth(draft: Draft, max_depth: int) -> Draft:
    """The draft's nodes of depth <= max_depth (parents re-indexed; order kept).

    >>> limit_depth(Draft([5, 6, 7], [-1, 0, -1], [0.5, 0.25, 0.2], 0.95, 2), 1).token_ids
    [5, 7]
    """
    depths = draft.depths()
    if all(d <= max_depth for d in depths):
        return draft
    return subtree(draft, [d <= max_depth for d in depths])


@torch.inference_mode()
def greedy_decode(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Iterable[int] | int | None = None) -> list[int]:
    """Plain greedy decoding in the simplest form (forward with a KV cache, argmax): the reference
    that speculative greedy decoding must equal token for token."""
    from .kv_cache import cache_kwarg, new_cache

    eos = _eos_set(eos_token_ids)
    cache = new_cache(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, S]
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True).logits  # [1, S, V]
        tok = int(torch.argmax(logits[0, -1]))
        out.append(tok)
        if tok in eos:
            break
        ids = torch.tensor([[tok]], dtype=torch.long, device=model.device)  # [1, 1]
    return out


def _prefill(model: Any, tokens: Sequence[int], prefixes: Any = None) -> Any:
    from .prefix_cache import PrefixCache

    return (prefixes if prefixes is not None else PrefixCache(0)).prefill(model, tokens)


def _eos_set(eos_token_ids: Iterable[int] | int | None) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(t) for t in eos_token_ids}


