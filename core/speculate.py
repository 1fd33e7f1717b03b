"""Drafters: SuffixDrafter speculates from a global index (past outputs) and a request index.

The request index holds this request's prompt plus its output so far, as one live sequence; the
global index holds finished outputs. Each step drafts from both and keeps the draft with the
higher SCORE (a tie goes to the longer match, then to the request index). When a request
finishes, its output enters the global index (online learning).

>>> from specx.core.suffix_index import SuffixIndex
>>> drafter = SuffixDrafter(SuffixIndex.build([[5, 6, 7, 8]]))
>>> drafter.start_request([1, 5, 6])
>>> drafter.speculate().token_ids
[7, 8]
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .draft import Draft
from .suffix_index import SuffixIndex, check_tokens, SuffixIndexError


class Drafter(Protocol):
    """Anything that proposes a draft for the running sequence."""

    def speculate(self, context: Sequence[int] | None = None) -> Draft: ...


class SuffixDrafter:
    """SuffixDecoding over a global and a per-request suffix index (DESIGN.md section 1)."""

    def __init__(self, global_index: SuffixIndex | None = None, *, max_depth: int = 64, max_spec_tokens: int = 32,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, tree: bool = True,
                 use_global: bool = True, use_request: bool = True) -> None:
        self.global_index = global_index if global_index is not None else SuffixIndex(max_depth)
        self.max_depth = max_depth
        self.max_spec_tokens = max_spec_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = tree
        self.use_global = use_global
        self.use_request = use_request
        self.request_index: SuffixIndex | None = None
        self._request_id = -1
        self._context = np.zeros(0, dtype=np.int32)
        self._num_prompt = 0

    def start_request(self, prompt: Sequence[int]) -> None:
        """Begin a request: its prompt becomes the request index."""
        arr = check_tokens(prompt, self.global_index.vocab_size, "prompt")
        self.request_index = SuffixIndex(self.max_depth, self.global_index.vocab_size)
        self._request_id = self.request_index.start(arr)
        self._context = arr.copy()
        self._num_prompt = len(arr)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the model produced (accepted + bonus); they join the request index at once."""
        if self.request_index is None:
            raise SuffixIndexError("no request started: call start_request(prompt) first")
        arr = check_tokens(tokens, self.global_index.vocab_size)
        self.request_index.append(self._request_id, arr)
        self._context = np.concatenate([self._context, arr])

    @property
    def output(self) -> np.ndarray:
        """This request's output so far."""
        return self._context[self._num_prompt :]

    def finish_request(self, learn: bool = True) -> None:
        """End the request; with `learn`, its output enters the global index."""
        if learn and len(self.output):
            self.global_index.add(self.output)
        self.request_index = None
        self._context = np.zeros(0, dtype=np.int32)
        self._num_prompt = 0

    def speculate(self, context: Sequence[int] | None = None) -> Draft:
        """Best draft for `context` (default: the running request's prompt + output)."""
        ctx = self._context if context is None else check_tokens(context, self.global_index.vocab_size, "context")
        ctx = ctx[-self.max_depth :]
        args = dict(max_spec_tokens=self.max_spec_tokens, max_spec_factor=self.max_spec_factor,
                    min_token_prob=self.min_token_prob, tree=self.tree)
        best = Draft()
        if self.use_request and self.request_index is not None:
            best = self.request_index.speculate(ctx, **args) or best
        if self.use_global:
            better = self.global_index.speculate(ctx, floor=(best.score, best.match_len), **args)
            if better is not None:
                best = better
        return best
