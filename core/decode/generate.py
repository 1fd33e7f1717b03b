"""Decoding with the model: core.decode.loop's loop with the model as verifier.

    steps = generate(model, prompt_ids, SuffixDrafter(index), max_new_tokens=64, eos_token_ids=[2])
    output = [tok for step in steps for tok in step.new_tokens]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ..draft import Draft
from ..model.llamacpp import on_llamacpp
from ..model.threads import ThreadTuner
from ..cost.acceptance import AcceptanceModel
from ..cost.forward import PassCost
from .loop import Step, Verdict, decode
from .speculate import Drafter
from .verify import Sampling, mask_logits, tree_unsupported, verify


class ModelVerifier:
    """The model as the decode loop's verifier: the prompt prefilled (through `prefix_cache` when
    one is given), then one forward pass per draft tree (core.decode.verify.verify), the KV cache pruned
    to the accepted path. The last prompt token stays pending: the first pass reads it together
    with the first draft, so even the first output token can come with accepted draft tokens."""

    finished = False

    def __init__(self, model: Any, sampling: Sampling, prefix_cache: Any = None, constraint: Any = None,
                 logprobs: int = -1) -> None:
        self.model, self.sampling, self.prefix_cache = model, sampling, prefix_cache
        self.logprobs = logprobs  # >= 0: each token's log-probability and that many alternatives
        self.constraint = constraint  # core.decode.grammar.Constraint: the draft comes pruned (core.decode.loop)
        self.vocab_size = model.config.vocab_size
        self.linear = tree_unsupported(model) is not None  # sliding-window layers: best paths, no trees
        self.cache: Any = None
        self.pending: list[int] = []

    def start(self, prompt: list[int]) -> None:
        self.cache = _prefill(self.model, prompt[:-1], self.prefix_cache)
        self.pending = [prompt[-1]]

    def verify(self, draft: Draft) -> Verdict:
        allowed = self.constraint.allowed(draft) if self.constraint is not None else None
        verdict = verify(self.model, self.cache, self.pending, draft, self.sampling, allowed, self.logprobs)
        if self.constraint is not None:
            self.constraint.advance(verdict.tokens)
        self.pending = [verdict.tokens[-1]]
        return verdict


def generate(model: Any, prompt_ids: Sequence[int], drafter: Drafter | None = None, max_new_tokens: int = 256,
             eos_token_ids: Iterable[int] | int | None = None, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, cost: PassCost | None = None,
             stop: Callable[[list[int]], int | None] | None = None,
             acceptance: AcceptanceModel | None = None, prefix_cache: Any = None,
             constraint: Any = None, logprobs: int = -1, threads: ThreadTuner | None = None,
             learn: bool = True) -> Iterator[Step]:
    """Decode up to `max_new_tokens` after `prompt_ids` with the model, yielding one Step per
    forward pass: core.decode.loop.decode with a ModelVerifier (its docstring says what `drafter`,
    `cost`, `stop` and `acceptance` do).

    Greedy output (temperature 0) equals plain greedy decoding token for token; with temperature
    > 0 every token has exactly the plain sampler's distribution, and the same `seed` gives the
    same text with or without a drafter (up to floating-point differences between the two
    passes). `prefix_cache` (a core.model.prefix_cache.PrefixCache shared by the requests) skips the
    prefill of the prompt's longest prefix it has seen before. `constraint` (a
    core.decode.grammar.Constraint, fresh for this decoding): every token follows its grammar, and the
    output equals constrained plain decoding's. `logprobs` >= 0: each Step carries its tokens'
    log-probabilities and that many top alternatives (core.decode.verify.token_logprobs). `threads` (see
    `thread_tuner`) picks each pass's thread count from the passes' times (a busy machine).
    `learn`: the drafter learns the output at the end (False: its indexes stay as they were).
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
    if on_llamacpp(model):  # a core.model.llamacpp.LlamaModel: its own prefix reuse
        from .llama_verify import LlamaVerifier

        verifier: Any = LlamaVerifier(model, sampling, constraint, logprobs)
    else:
        verifier = ModelVerifier(model, sampling, prefix_cache, constraint, logprobs)
    yield from decode(verifier, prompt, drafter, max_new_tokens, _eos_set(eos_token_ids), cost, stop, acceptance,
                      learn=learn, constraint=constraint, threads=threads)


def thread_tuner(model: Any, say: Callable[[str], None] = lambda message: None) -> ThreadTuner | None:
    """A core.model.threads.ThreadTuner between torch's thread count (llama.cpp's, for a LlamaModel) and
    one, for a model on the CPU (None on a GPU, or with one thread already). Share one between the
    requests of a run."""
    if on_llamacpp(model):
        return ThreadTuner((model.threads, 1), model.set_threads, say) if model.threads > 1 else None
    threads = torch.get_num_threads()
    if model.device.type != "cpu" or threads <= 1:
        return None
    return ThreadTuner((threads, 1), set_threads, say)


def set_threads(n: int) -> None:
    """Run this thread's next passes on n threads: torch's and numba's (core.model.matmul) pools."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    import numba

    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


@torch.inference_mode()
def greedy_decode(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_ids: Iterable[int] | int | None = None, constraint: Any = None) -> list[int]:
    """Plain greedy decoding in the simplest form (forward with a KV cache, argmax): the reference
    that speculative greedy decoding must equal token for token. With `constraint` (a fresh
    core.decode.grammar.Constraint), the argmax of the tokens its grammar allows: constrained greedy."""
    from ..model.kv_cache import cache_kwarg, new_cache

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


def _prefill(model: Any, tokens: Sequence[int], prefixes: Any = None) -> Any:
    from ..model.prefix_cache import PrefixCache

    return (prefixes if prefixes is not None else PrefixCache(0)).prefill(model, tokens)


def _eos_set(eos_token_ids: Iterable[int] | int | None) -> set[int]:
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(t) for t in eos_token_ids}


