"""Decoding with the model: core.decode.loop's loop with an engine (core.model.engine.Engine) as
verifier, through core.decode.verifiers.model.ModelVerifier.

    engine, tokenizer = load_backend("smollm2-135m")   # core.model.load
    steps = generate(engine, prompt_ids, SuffixDrafter(index), Decoding(max_new_tokens=64, eos_token_ids=[2]))
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
from .loop import Step, decode
from .request import Decoding, as_ids
from .speculate import Drafter
from .verifiers.model import ModelVerifier
from .verify import Sampling, mask_logits


def generate(engine: Engine, prompt_ids: Sequence[int], drafter: Drafter | None = None,
             settings: Decoding = Decoding(), *, cost: PassCost | None = None,
             stop: Callable[[list[int]], int | None] | None = None, constraint: Any = None,
             acceptance: AcceptanceModel | None = None, prefix_cache: Any = None, learn: bool = True,
             successors: SuccessorTable | None = None) -> Iterator[Step]:
    """Decode what `settings` (a core.decode.request.Decoding: the limit, end tokens, sampling and
    log-probabilities the request asks for) after `prompt_ids` with the model, yielding one Step
    per forward pass of `engine`: core.decode.loop.decode with a ModelVerifier (its docstring says
    what `drafter`, `cost`, `stop` and `acceptance` do).

    Greedy output (temperature 0) equals plain greedy decoding token for token; with temperature
    > 0 every token has exactly the plain sampler's distribution, and the same seed gives the
    same text with or without a drafter (up to floating-point differences between the two
    passes). `settings.logprobs` >= 0: each Step carries its tokens' log-probabilities and that
    many top alternatives (core.decode.verify.token_logprobs).

    What enforces the settings' stop strings and grammar is this decoding's own, made by the caller:
    `stop` (a core.decode.text.TextStream of the stop strings) and `constraint` (a fresh
    core.decode.grammar.Constraint, `settings.constraint(vocabulary)`: every token follows its
    grammar, and the output equals constrained plain decoding's).

    The rest is the runner's, not the request's. `prefix_cache` (a core.model.prefix_cache.PrefixCache, from
    the engine's new_prefix_cache) skips the prefill of the prompt's longest prefix it has seen
    before (llama.cpp keeps its own). `learn`: the drafter learns the output at the end (False: its
    indexes stay as they were). `successors` (a
    core.index.successors.SuccessorTable, the one a HybridDrafter drafts from): every pass's rows
    teach it the model's likely next tokens (core.decode.verify.learn_successors).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: decoding needs at least one token")
    if settings.stop and stop is None:
        raise ValueError("the settings have stop strings: pass stop=, a TextStream of them")
    if settings.grammar and constraint is None:
        raise ValueError("the settings have a grammar: pass constraint=settings.constraint(vocabulary)")
    generator = torch.Generator(device="cpu")
    if settings.seed is None:
        generator.seed()
    else:
        generator.manual_seed(settings.seed)
    sampling = Sampling(float(settings.temperature), int(settings.top_k), float(settings.top_p), generator)
    verifier = ModelVerifier(engine, sampling, prefix_cache=prefix_cache, constraint=constraint,
                             logprobs=settings.logprobs, successors=successors)
    yield from decode(verifier, prompt, drafter, settings.max_new_tokens, settings.eos_token_ids, cost, stop,
                      acceptance, learn=learn, constraint=constraint)


@torch.inference_mode()
def greedy_decode(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Iterable[int] | int | None = None, constraint: Any = None) -> list[int]:
    """Plain greedy decoding of a transformers model in the simplest form (forward with a KV cache,
    argmax): the reference that speculative greedy decoding must equal token for token. With
    `constraint` (a fresh core.decode.grammar.Constraint), the argmax of the tokens its grammar
    allows: constrained greedy."""
    from ..model.transformers.kv_cache import cache_kwarg, new_cache

    eos = as_ids(eos_token_ids)
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
