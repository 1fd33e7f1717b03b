"""A llama.cpp model (core.model.llamacpp.LlamaModel) as the decode loop's verifier.

Drafts are verified as their best path (`linear`): on llama.cpp's CPU backend a pass costs nearly
in proportion to its tokens, so a tree's branches cost as much as the path's tokens
(docs/llamacpp.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..model.llamacpp import LlamaModel
from .verify import judge


class LlamaVerifier:
    """A LlamaModel as the decode loop's verifier (core.decode.loop.Verifier): the prompt's longest
    cached prefix kept, the rest prefilled but its last token, which stays pending and is read with
    the first draft; then one pass per draft (its best path), judged by core.decode.verify.judge."""

    finished = False
    linear = True

    def __init__(self, model: LlamaModel, sampling: Any, constraint: Any = None, logprobs: int = -1) -> None:
        self.model, self.sampling, self.constraint, self.logprobs = model, sampling, constraint, logprobs
        self.vocab_size = model.vocab_size
        self.pending: list[int] = []

    def start(self, prompt: list[int]) -> None:
        head = prompt[:-1]
        kept = self.model.reuse(head)
        self.model.hit_tokens += kept
        if kept < len(head):
            self.model.forward(head[kept:])
        self.pending = [prompt[-1]]

    def verify(self, draft: Any) -> Any:
        allowed = self.constraint.allowed(draft) if self.constraint is not None else None
        num_kept = len(self.model.cached) + len(self.pending)
        rows = self.model.forward(self.pending + list(draft.token_ids), logits_from=len(self.pending) - 1)
        verdict = judge(torch.from_numpy(rows), draft, self.sampling, allowed, self.logprobs)
        self.model.keep(num_kept + verdict.num_accepted)  # linear drafts: the accepted nodes lead
        if self.constraint is not None:
            self.constraint.advance(verdict.tokens)
        self.pending = [verdict.tokens[-1]]
        return verdict
