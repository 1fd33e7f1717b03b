"""What a forward pass costs, and how much draft that pays for.

On a CPU the time of one verification pass grows quickly with the number of tokens verified; on
a GPU it is nearly flat for small trees. So the right draft size depends on the hardware: measure
seconds(n) once (`calibrate`), then keep the draft's most likely nodes only while the expected
tokens per second of the step improves (`size_draft`):

    rate(k) = (1 + sum of the k largest D) / seconds(pending + k)

(each step emits its accepted tokens plus one). A child's D never exceeds its parent's, so taking
nodes by D keeps the kept set a tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .draft import Draft


@dataclass(frozen=True)
class ForwardCost:
    """Measured seconds of one verification pass over n tokens on a cache of `context` tokens
    (linear in between and beyond); with a second curve at `long_context`, linear in the cache
    length too (attention reads the whole cache for every token verified)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    context: int = 128
    long_seconds: tuple[float, ...] | None = None
    long_context: int = 0

    def __call__(self, n: int, context: int | None = None) -> float:
        short = _curve(self.sizes, self.seconds, n)
        if self.long_seconds is None or context is None or self.long_context <= self.context:
            return short
        w = (context - self.context) / (self.long_context - self.context)
        return max(short + w * (_curve(self.sizes, self.long_seconds, n) - short), 0.25 * short)


def _curve(sizes: Sequence[int], seconds: Sequence[float], n: int) -> float:
    xs, ys = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if n <= xs[-1] or len(xs) < 2:
        return float(np.interp(n, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(ys[-1] + slope * (n - xs[-1]))


class AcceptanceCalibration:
    """Accepted draft tokens over the drafts' predicted scores, recent steps weighted most: the
    factor by which the drafter's D(N) estimates are overconfident on this workload (capped at 1),
    kept per match-length bucket (1, 2, 3-4, 5-8, 9-16, 17+ tokens): a draft continuing a 1-token
    match is worth much less than its counts say, one continuing a 20-token match about as much.

    Sums decay by `decay` per step of the bucket (a window of about 1 / (1 - decay) steps) and
    start from `prior` tokens of perfect calibration, so one step cannot swing it.
    """

    BUCKETS = 6

    def __init__(self, prior: float = 4.0, decay: float = 0.9) -> None:
        self.accepted = [prior] * self.BUCKETS
        self.expected = [prior] * self.BUCKETS
        self.decay = decay

    @classmethod
    def bucket(cls, match_len: int) -> int:
        return min((max(int(match_len), 1) - 1).bit_length(), cls.BUCKETS - 1)

    def factor(self, match_len: int = 1) -> float:
        b = self.bucket(match_len)
        return min(self.accepted[b] / self.expected[b], 1.0)

    def update(self, expected: float, accepted: int, match_len: int = 1) -> None:
        b = self.bucket(match_len)
        self.expected[b] = self.decay * self.expected[b] + expected
        self.accepted[b] = self.decay * self.accepted[b] + accepted


def subtree(draft: Draft, keep: Sequence[bool]) -> Draft:
    """The draft's nodes where `keep` is true (their parents must be kept too), re-indexed, order kept.

    >>> subtree(Draft([5, 6, 7], [-1, 0, -1], [0.5, 0.25, 0.2], 0.95, 2), [True, False, True]).token_ids
    [5, 7]
    """
    new_index: dict[int, int] = {}
    tokens, parents, probs = [], [], []
    for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents)):
        if keep[i] and (par < 0 or par in new_index):
            new_index[i] = len(tokens)
            tokens.append(tok)
            parents.append(-1 if par < 0 else new_index[par])
            if draft.probs:
                probs.append(draft.probs[i])
    return Draft(tokens, parents, probs, float(sum(probs)), draft.match_len)


def size_draft(draft: Draft, cost: ForwardCost, num_pending: int = 1, calibration: float = 1.0,
               context: int | None = None) -> Draft:
    """The draft cut to the size that maximises expected tokens per second of the step.

    `calibration` scales the drafter's probabilities by what verification has shown them to be
    worth (see AcceptanceCalibration): counts from a few observations overstate them. `context` is
    the number of tokens in the cache (a longer one makes each verified token dearer).
    """
    n = len(draft)
    if n == 0:
        return draft
    probs = [calibration * p for p in draft.probs] if draft.probs else [calibration] * n
    order = sorted(range(n), key=lambda i: (-probs[i], i))
    chosen: set[int] = set()
    taken: list[int] = []
    best_k, best_rate, expected = 0, 1.0 / cost(num_pending, context), 1.0
    for i in order:
        if draft.parents[i] >= 0 and draft.parents[i] not in chosen:
            continue  # a child more likely than its parent (not from suffix drafts): keep it a tree
        chosen.add(i)
        taken.append(i)
        expected += probs[i]
        rate = expected / cost(num_pending + len(taken), context)
        if rate > best_rate:
            best_k, best_rate = len(taken), rate
    keep = [False] * n
    for i in taken[:best_k]:
        keep[i] = True
    return subtree(draft, keep)


SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # dense where CPU GEMMs change kernels (3 -> 4 tokens)


def calibrate(model: Any, sizes: Sequence[int] = SIZES, repeats: int = 3, context: int = 128,
              max_size: int | None = None, long_context: int | None = 1024) -> ForwardCost:
    """Time one verification pass over n tokens (a linear draft of n - 1 after one pending token)
    on a cache of `context` tokens, and of `long_context` tokens (None: skip); the median of
    `repeats` runs per size, after a warm-up. `max_size` drops larger sizes (a step never verifies
    more than 1 + max draft tokens)."""
    if max_size is not None:
        sizes = [n for n in sizes if n <= max_size] or [1]
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if long_context is not None and limit and long_context + max(sizes) > limit:
        long_context = None  # a model with a short context: one curve
    short = _time_passes(model, sizes, repeats, context)
    long = _time_passes(model, sizes, repeats, long_context) if long_context else None
    return ForwardCost(tuple(int(s) for s in sizes), short, context, long, long_context or 0)


def _time_passes(model: Any, sizes: Sequence[int], repeats: int, context: int) -> tuple[float, ...]:
    import torch

    from .generate import _prefill
    from .verify import tree_logits

    rng = np.random.default_rng(0)
    vocab = int(model.config.vocab_size)
    cache = _prefill(model, rng.integers(0, vocab, size=context).tolist())
    seconds = []
    # a GPU runs the pass asynchronously: wait for it (a step waits too, when it reads the logits)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for n in sizes:
            draft_tokens = rng.integers(0, vocab, size=n - 1).tolist()
            draft = Draft(draft_tokens, list(range(-1, n - 2)), [1.0] * (n - 1), float(n - 1), 1)
            runs = []
            for r in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                tree_logits(model, cache, [int(rng.integers(vocab))], draft)
                sync()
                if r:  # the first run warms up
                    runs.append(time.perf_counter() - t0)
                cache.crop(-n)
            seconds.append(float(np.median(runs)))
    return tuple(seconds)
