"""What one request asks of a decoding (issue 60): its limit, end tokens, sampling, stop strings,
grammar and log-probabilities as one frozen value, checked once where it is made (`specx
generate`'s options, an HTTP body in cli/http/requests.py, a benchmark, a test) and handed down
unchanged to core.decode.generate.generate.

    settings = Decoding(max_new_tokens=64, eos_token_ids=tok.eos_token_id, temperature=0.7, seed=1)
    steps = generate(engine, prompt_ids, drafter, settings)

What the server or the machine brings to every request (the drafter, the pass cost, the acceptance
model, the prefix cache, the successor table) is not in it, nor whose request it
is (a server's tenant, core.serve.job.GenerationRequest's: it picks those): generate takes them as
keywords.

The stop strings and the grammar are kept as asked, as text: each decoding enforces them with an
object of its own that holds its state (a core.decode.text.TextStream, which needs the tokenizer;
a core.decode.grammar.Constraint, which needs the grammar vocabulary: `constraint()` makes it). The
caller makes them per decoding and passes them to generate as `stop=` and `constraint=`; generate
refuses settings whose stop strings or grammar nothing would enforce.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Decoding:
    """One request's decoding settings; ValueError names the one out of range.

    `max_new_tokens`: the most tokens to generate; `eos_token_ids`: the tokens that end decoding
    (an int, None or any iterable of ints, kept as a tuple); `temperature` (0: greedy), `top_p`
    (the nucleus mass, in (0, 1]), `top_k` (0: all tokens) and `seed` (None: a fresh one) sample;
    `stop`: strings the text ends before (a string or any iterable of them, kept as a tuple);
    `grammar`: an llguidance grammar every token follows (None: free text); `logprobs` >= 0: each
    step carries its tokens' log-probabilities and that many top alternatives (-1: none)."""

    max_new_tokens: int = 256
    eos_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    logprobs: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", as_ids(self.eos_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()))
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.logprobs < -1:
            raise ValueError(f"logprobs must be >= 0, or -1 for none, got {self.logprobs}")

    def for_choice(self, index: int) -> Decoding:
        """The settings of choice `index` of a request asking for several (OpenAI's `n`): a given
        seed counts up by the index, so the choices differ and each can be had again.

        >>> Decoding(seed=7).for_choice(2).seed, Decoding().for_choice(2).seed
        (9, None)
        """
        return self if self.seed is None else replace(self, seed=self.seed + index)

    def constraint(self, vocabulary: Any) -> Any:
        """A fresh core.decode.grammar.Constraint of `grammar` under `vocabulary` (a
        core.decode.grammar.Vocabulary) for one decoding, these end tokens allowed where it ends;
        None without a grammar."""
        return vocabulary.constraint(self.grammar, self.eos_token_ids) if self.grammar else None


def as_ids(tokens: Iterable[int] | int | None) -> tuple[int, ...]:
    """Token ids given as one id, None (none) or any iterable of them, as a tuple."""
    if tokens is None:
        return ()
    if isinstance(tokens, int):
        return (tokens,)
    return tuple(int(t) for t in tokens)
