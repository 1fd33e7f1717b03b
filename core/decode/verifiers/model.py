"""The model as the decode loop's verifier, whatever engine runs it (core.model.engine.Engine)."""

from __future__ import annotations

from typing import Any

from ...draft import Draft
from ...index.successors import SuccessorTable
from ...model.engine import Engine, Session
from ...model.threads import last_threads
from ..loop import Verdict
from ..verify import Sampling, verify


class ModelVerifier:
    """An engine as the decode loop's verifier: the prompt but its last token goes into a session
    (its longest cached prefix reused: through `prefix_cache` on transformers, llama.cpp's own
    sequence), then one pass per draft (core.decode.verify.verify), the cache kept to the accepted
    path. The last prompt token stays pending: the first pass reads it together with the first
    draft, so even the first output token can come with accepted draft tokens. An engine that
    verifies linear drafts only (`tree_unsupported`) gets each tree's best path (`linear`)."""

    finished = False

    def __init__(self, engine: Engine, sampling: Sampling, *, prefix_cache: Any = None, constraint: Any = None,
                 logprobs: int = -1, successors: SuccessorTable | None = None) -> None:
        self.engine, self.sampling, self.prefix_cache = engine, sampling, prefix_cache
        self.logprobs = logprobs  # >= 0: each token's log-probability and that many alternatives
        self.constraint = constraint  # core.decode.grammar.Constraint: the draft comes pruned (core.decode.loop)
        self.successors = successors  # core.index.successors.SuccessorTable: each pass's rows teach it
        self.vocab_size = engine.vocab_size
        self.linear = engine.tree_unsupported is not None
        self.session: Session | None = None
        self.pending: list[int] = []

    def start(self, prompt: list[int]) -> None:
        self.session = self.engine.start(prompt[:-1], self.prefix_cache)
        self.pending = [prompt[-1]]

    def verify(self, draft: Draft) -> Verdict:
        allowed = self.constraint.allowed(draft) if self.constraint is not None else None
        verdict = verify(self.session, self.pending, draft, self.sampling, allowed=allowed, logprobs=self.logprobs,
                         successors=self.successors)
        if self.constraint is not None:
            self.constraint.advance(verdict.tokens)
        self.pending = [verdict.tokens[-1]]
        verdict.threads = last_threads(self.engine.tuner)
        return verdict
