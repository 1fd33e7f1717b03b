"""Drafters: SuffixDrafter speculates from a global index (past outputs) and a request index.

The request index holds this request's prompt plus its output so far, as one live sequence; the
global index holds finished outputs. Each step drafts the best tree from each (highest SCORE over
all match lengths; a tie goes to the longer match) and, by default, verifies their union: the
better tree first, then the other's nodes while max_spec_tokens allows. The union accepts at
least as much as either tree, and on agent logs it adds about 0.1-0.15 tokens per step for under
one more draft token (see the README); `merge_indexes=False` keeps only the better tree (a tie
goes to the request index), the original method's rule (docs/design.md, "The method"). When a
request finishes, its output enters the global index (online learning).

>>> from specx.core.index.suffix_index import SuffixIndex
>>> drafter = SuffixDrafter(SuffixIndex.build([[5, 6, 7, 8]]))
>>> drafter.start_request([1, 5, 6])
>>> drafter.speculate().token_ids
[7, 8]
"""

from __future__ import annotations

import copy
from typing import Protocol, Sequence

import numpy as np
from numba import njit

from ..draft import GLOBAL, PREDICTION, REQUEST, Draft
from ..index.suffix_index import SuffixIndex, check_speculate_args
from ..index.tokens import SuffixIndexError, check_tokens
from ..numba_cache import configure as configure_numba_cache

configure_numba_cache()  # before any kernel here is decorated


class Drafter(Protocol):
    """What the decode loop (core.decode.generate) and the model-free replay (core.predict.replay) drive: a request
    begins with its prompt, each verification step's tokens (accepted + bonus) extend it, a draft
    is asked for before each step, and the request ends, its output learned or not. A server's
    drafters also `fork()`: a drafter for one more concurrent request, its request state its own
    and what it drafts from (indexes, tables) shared."""

    def start_request(self, prompt: Sequence[int]) -> None: ...

    def extend(self, tokens: Sequence[int]) -> None: ...

    def speculate(self) -> Draft: ...

    def finish_request(self, learn: bool = True) -> None: ...


class SuffixDrafter:
    """SuffixDecoding over a global and a per-request suffix index (docs/design.md, "The method")."""

    def __init__(self, global_index: SuffixIndex | None = None, *, max_depth: int = 64, max_spec_tokens: int = 32,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, tree: bool = True,
                 use_global: bool = True, use_request: bool = True, merge_indexes: bool = True) -> None:
        check_speculate_args(None, max_spec_tokens, max_spec_factor, min_token_prob, max_depth)
        self.global_index = global_index if global_index is not None else SuffixIndex(max_depth)
        self.max_depth = max_depth
        self.max_spec_tokens = max_spec_tokens
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.tree = bool(tree)
        self.use_global = use_global
        self.use_request = use_request
        self.merge_indexes = merge_indexes
        self.request_index: SuffixIndex | None = None
        self._request_id = -1
        self._num_prompt = 0

    def start_request(self, prompt: Sequence[int]) -> None:
        """Begin a request: its prompt becomes the request index."""
        arr = check_tokens(prompt, self.global_index.vocab_size, "prompt")
        self.request_index = SuffixIndex(self.max_depth, self.global_index.vocab_size)
        self._request_id = self.request_index.start(arr)
        self._num_prompt = len(arr)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens the model produced (accepted + bonus); they join the request index at once."""
        if self.request_index is None:
            raise SuffixIndexError("no request started: call start_request(prompt) first")
        self.request_index.append(self._request_id, check_tokens(tokens, self.global_index.vocab_size), checked=True)

    @property
    def context(self) -> np.ndarray:
        """The running sequence: prompt + output so far (a view)."""
        if self.request_index is None:
            return np.zeros(0, dtype=np.int32)
        return self.request_index.live_tokens(self._request_id)

    @property
    def output(self) -> np.ndarray:
        """This request's output so far."""
        return self.context[self._num_prompt :]

    def fork(self) -> SuffixDrafter:
        """This drafter for one more concurrent request: the global index shared, no request begun."""
        mine = copy.copy(self)
        mine.request_index, mine._num_prompt = None, 0
        return mine

    def finish_request(self, learn: bool = True) -> None:
        """End the request; with `learn`, its output enters the global index."""
        if learn and len(self.output):
            self.global_index.add(self.output.copy())
        self.request_index = None
        self._num_prompt = 0

    def speculate(self, context: Sequence[int] | None = None) -> Draft:
        """Best draft for `context` (default: the running request's prompt + output)."""
        if context is None:
            ctx = self.context[-self.max_depth :]
            if len(ctx) == 0:  # an empty prompt, before the first token: nothing to match yet
                return Draft()
        else:
            ctx = check_tokens(context, self.global_index.vocab_size, "context")[-self.max_depth :]
            if len(ctx) == 0:
                raise SuffixIndexError("context is empty: speculation needs at least one token to match")
        args = (self.max_spec_tokens, self.max_spec_factor, self.min_token_prob, self.tree)
        best = Draft()
        if self.use_request and self.request_index is not None:
            best = (self.request_index.speculate(ctx, *args, checked=True) or best).tagged(REQUEST)
        if not self.use_global:
            return best
        if not self.merge_indexes:
            better = self.global_index.speculate(ctx, *args, floor=(best.score, best.match_len), checked=True)
            return better.tagged(GLOBAL) if better is not None else best
        other = (self.global_index.speculate(ctx, *args, checked=True) or Draft()).tagged(GLOBAL)
        return best.union(other, self.max_spec_tokens)


@njit(cache=True, nogil=True)
def _earliest_ngram(context: np.ndarray, max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """(n, start) of the earliest earlier occurrence of the longest suffix n-gram, n from max to min.

    The occurrence must be followed by at least one token inside the context; (0, -1) when none.
    """
    t = len(context)
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        for j in range(0, t - n):
            k = 0
            while k < n and context[j + k] == context[t - n + k]:
                k += 1
            if k == n:
                return n, j
    return 0, -1


class PromptLookupDrafter:
    """The prompt-lookup baseline: the longest suffix n-gram (n = 5..1) of the running sequence
    that occurs earlier in it (earliest occurrence), drafting the max_spec_tokens that follow it.
    No global index: it only ever looks inside the request."""

    def __init__(self, max_spec_tokens: int = 32, max_ngram: int = 5, min_ngram: int = 1) -> None:
        self.max_spec_tokens = max_spec_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._context = np.zeros(0, dtype=np.int32)

    def start_request(self, prompt: Sequence[int]) -> None:
        self._context = check_tokens(prompt, None, "prompt").copy()

    def extend(self, tokens: Sequence[int]) -> None:
        self._context = np.concatenate([self._context, check_tokens(tokens, None)])

    def finish_request(self, learn: bool = True) -> None:
        self._context = np.zeros(0, dtype=np.int32)

    def speculate(self, context: Sequence[int] | None = None) -> Draft:
        ctx = self._context if context is None else check_tokens(context, None, "context")
        n, start = _earliest_ngram(ctx, self.max_ngram, self.min_ngram)
        if n == 0:
            return Draft()
        tokens = ctx[start + n : start + n + self.max_spec_tokens].tolist()
        return Draft(tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens), float(len(tokens)), n)


class PredictionDrafter:
    """A client's prediction of the output (OpenAI's Predicted Outputs: the file an edit rewrites)
    as the first draft source, `inner`'s drafts (a Drafter, or None) filling the room left.

    The prediction is indexed alone; each step the running context's suffix is matched in it as
    the suffix drafter matches, with drafts up to `max_spec_tokens` after any match, so the draft
    finds its place again after the model departs from the prediction and comes back to it. Before
    any output it is the prediction's start. Its nodes are tagged PREDICTION and go first.

    >>> drafter = PredictionDrafter([7, 8, 9, 7, 5], None, max_spec_tokens=3)
    >>> drafter.start_request([1, 2])
    >>> drafter.speculate().token_ids
    [7, 8, 9]
    >>> drafter.extend([7, 8, 9, 7])  # after "... 9, 7": the prediction's last 7 is the longer match
    >>> drafter.speculate().token_ids
    [5]
    """

    def __init__(self, prediction: Sequence[int], inner: Drafter | None = None, *, max_spec_tokens: int = 32,
                 max_depth: int = 64) -> None:
        tokens = check_tokens(prediction, None, "prediction")
        self.prediction = tokens
        self.index = SuffixIndex.build([tokens], max_depth) if len(tokens) else None
        self.inner = inner
        self.max_spec_tokens = max_spec_tokens
        self.max_depth = max_depth
        self.context: list[int] = []
        self.num_out = 0

    def start_request(self, prompt: Sequence[int]) -> None:
        self.context = [int(t) for t in prompt[-self.max_depth :]]
        self.num_out = 0
        if self.inner is not None:
            self.inner.start_request(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        self.context = (self.context + [int(t) for t in tokens])[-self.max_depth :]
        self.num_out += len(tokens)
        if self.inner is not None:
            self.inner.extend(tokens)

    def finish_request(self, learn: bool = True) -> None:
        if self.inner is not None:
            self.inner.finish_request(learn)

    def speculate(self) -> Draft:
        other = self.inner.speculate() if self.inner is not None else Draft()
        own = Draft()
        if self.index is not None and self.max_spec_tokens:
            if self.num_out == 0:
                head = self.prediction[: self.max_spec_tokens].tolist()
                own = Draft(head, list(range(-1, len(head) - 1)), [1.0] * len(head), float(len(head)), 0)
            elif self.context:
                ctx = np.asarray(self.context, dtype=np.int32)
                own = self.index.speculate(ctx, self.max_spec_tokens, float(self.max_spec_tokens), 0.0,
                                           tree=False) or Draft()
        if not len(own):
            return other
        own = own.tagged(PREDICTION)
        return own.merge(other, len(own) + len(other)) if len(other) else own
