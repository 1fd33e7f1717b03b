"""Decoding with the model: core.decode.loop's loop with an engine (core.model.engine.Engine) as
verifier, through core.decode.verifiers.model.ModelVerifier.

    engine, tokenizer = load_backend("smollm2-135m")   # core.model.load
    steps = generate(engine, prompt_ids, SuffixDrafter(index), max_new_tokens=64, eos_token_ids=[2])
    output = [tok for step in steps for tok in step.new_tokens]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..cost.acceptance import AcceptanceModel
from ..cost.forward import PassCost
from ..draft import Draft
from ..index.successors import SuccessorTable
from ..model.engine import Engine
from ..model.threads import ThreadTuner
from .loop import Step, decode
from .speculate import Drafter
from .verifiers.model import ModelVerifier
from .verify import Sampling, mask_logits


def generate(engine: Engine, prompt_ids: Sequence[int], drafter: Drafter | None = None, *, max_new_tokens: int = 256,
             eos_token_ids: Iterable[int] | int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, cost: PassCost | None = None,
             stop: Callable[[list[int]], int | None] | None = None,
             acceptance: AcceptanceModel | None = None, prefix_cache: Any = None,
             constraint: Any = None, logprobs: int = -1, threads: ThreadTuner | None = None,
             learn: bool = True, successors: SuccessorTable | None = None) -> Iterator[Step]:
    """Decode up to `max_new_tokens` after `prompt_ids` with the model, yielding one Step per
    forward pass of `engine`: core.decode.loop.decode with a ModelVerifier (its docstring says what `drafter`,
    `cost`, `stop` and `acceptance` do).

    Greedy output (temperature 0) equals plain greedy decoding token for token; with temperature
    > 0 every token has exactly the plain sampler's distribution, and the same `seed` gives the
    same text with or without a drafter (up to floating-point differences between the two
    passes). `prefix_cache` (a core.model.prefix_cache.PrefixCache shared by the requests, from the
    engine's new_prefix_cache) skips the prefill of the prompt's longest prefix it has seen before
    (llama.cpp keeps its own). `constraint` (a
    core.decode.grammar.Constraint, fresh for this decoding): every token follows its grammar, and the
    output equals constrained plain decoding's. `logprobs` >= 0: each Step carries its tokens'
    log-probabilities and that many top alternatives (core.decode.verify.token_logprobs). `threads` (the
    engine's `thread_tuner()`) picks each pass's thread count from the passes' times (a busy machine).
    `learn`: the drafter learns the output at the end (False: its indexes stay as they were).
    `successors` (a core.index.successors.SuccessorTable, the one a HybridDrafter drafts from): every
    pass's rows teach it the model's likely next tokens (core.decode.verify.learn_successors).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: decoding needs at least one token")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or temperature < 0:
        raise ValueError("top_k and temperature must be >= 0")
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    sampling = Sampling(float(temperature), int(top_k), float(top_p), generator)
    verifier = ModelVerifier(engine, sampling, prefix_cache=prefix_cache, constraint=constraint, logprobs=logprobs,
                             successors=successors)
    yield from decode(verifier, prompt, drafter, max_new_tokens, _eos_set(eos_token_ids), cost, stop, acceptance,
                      learn=learn, constraint=constraint, threads=threads)


@torch.inference_mode()
def greedy_decode(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Iterable[int] | int | None = None, constraint: Any = None) -> list[int]:
    """Plain greedy decoding of a transformers model in the simplest form (forward with a KV cache,
    argmax): the reference that speculative greedy decoding must equal token for token. With
    `constraint` (a fresh core.decode.grammar.Constraint), the argmax of the tokens its grammar
    allows: constrained greedy."""
    from ..model.transformers.kv_cache import cache_kwarg, new_cache

    eos = _eos_set(eos_token_ids)
    cache = new_cache(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)  # [1, S]
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True).logits  # [1, S, V]
        last = logits[0, -1]
        if constraint is not None:
            mask_logits(last[None], constraint.allowed(Draft())[:1])  # the tokens allowed next
        tok = int(torch.argmax(last))
        out.append(tok)
        if tok in eos:
            break
        if constraint is not None:
            constraint.advance([tok])
        ids = torch.tensor([[tok]], dtype=torch.long, device=model.device)  # [1, 1]
    return out


def _eos_set(eos_token_ids: Iterable[int] | int | None) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(t) for t in eos_token_ids}


