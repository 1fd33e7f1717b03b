"""Empirical entropy of a workload: how predictable is the next token from the text before it?

SuffixDecoding (docs/design.md, "The method") drafts the continuation of a context from what followed the
same context in earlier outputs. If what follows a context is nearly always the same token, drafts
are long and accepted; if it is spread over many tokens, drafting is guesswork. The empirical
entropy measures that spread on a sample of outputs before any GPU time is spent.

Definition. A *context* c of length d is a d-token string occurring inside a sequence and followed,
in the same sequence, by a token. n_c counts those occurrences, and H(next | c) is the entropy in
bits of the empirical distribution of the token that follows them. Then

    entropy_bits = sum_{d=1..max_depth} sum_{|c|=d} n_c * H(next | c)  /  sum_{d=1..max_depth} sum_{|c|=d} n_c

that is, every node of the suffix trie (depth 1..max_depth) that has a child contributes the entropy
of its children, weighted by its occurrences that have a child. Occurrences never cross sequence
boundaries, and the end of a sequence is not an outcome: an occurrence at the very end of a
sequence is not counted at all. An end says nothing about which token to draft next (a finished
output is never continued), so counting it would make a corpus of short outputs look less
predictable than it is for drafting.

The plain order-k conditional entropies H(X_i | X_{i-k..i-1}) (k = 0: the unigram entropy of all
tokens) come along: order k is the depth-k term alone, over positions i >= k of each sequence.

Worked example: sequences [[1, 2, 3, 1, 2, 4]].
  order 0: tokens {1: 2, 2: 2, 3: 1, 4: 1} -> H = 1.918 bits over 6 tokens.
  depth 1: context 1 -> {2: 2} (0 bits), 2 -> {3: 1, 4: 1} (1 bit), 3 -> {1: 1} (0 bits);
           the final 4 is followed by nothing: not a context. 5 occurrences, 2 * 1 bit -> order-1
           entropy 2/5 = 0.4 bits.
  depth 2: [1,2] -> {3: 1, 4: 1} (1 bit), [2,3] -> {1}, [3,1] -> {2}: 4 occurrences, 2 bits.
  depth 3: [1,2,3] -> {1}, [2,3,1] -> {2}, [3,1,2] -> {4}: 3 occurrences, 0 bits.
  depths 4, 5: 2 + 1 occurrences, 0 bits. ([1,2,3,1,2,4] itself is followed by nothing.)
  entropy_bits = (2 + 2) / (5 + 4 + 3 + 2 + 1) = 4 / 15 = 0.267 bits.

How it is computed. The sequences are concatenated with SEP after each and suffix-sorted (the
suffix array of core/index/suffix_array.py). The occurrences of a context are a contiguous range of the
suffix array, and the trie nodes that branch are the lcp-intervals, so one left-to-right pass over
the array with a stack of open intervals visits every branching node once: O(n) after the sort.
A node of depth d with m occurrences followed by a token, split m = m_1 + ... + m_r by that token,
contributes m*H = f(m) - sum_j f(m_j) with f(x) = x*log2(x); non-branching depths contribute 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numba import njit

from ..index.suffix_array import SEP, SORT_DEPTH, build_suffix_array
from ..index.tokens import MAX_TOKEN
from ..numba_cache import configure as configure_numba_cache

configure_numba_cache()  # before any kernel here is decorated

# The deepest context the suffix array orders correctly is SORT_DEPTH tokens; the pass below reads
# lcp values up to max_depth + 1, so half of it leaves ample room (and matches the index's limit).
MAX_DEPTH_LIMIT = SORT_DEPTH // 2


class EntropyError(ValueError):
    """Bad argument to the entropy estimate: the message says which and why."""


@dataclass(frozen=True)
class EntropyResult:
    """Empirical entropy of a set of sequences; see the module docstring for the definitions."""

    entropy_bits: float  # suffix-index empirical entropy, depths 1..max_depth
    order_bits: list[float]  # order_bits[k] = H(X_i | X_{i-k..i-1}); NaN where no position has k tokens before it
    num_sequences: int
    num_tokens: int
    num_contexts: int  # sum over depths 1..max_depth of n_c: the denominator of entropy_bits
    max_depth: int


def empirical_entropy(
    sequences: Sequence[np.ndarray | Sequence[int]], max_depth: int = 64, orders: int = 4
) -> EntropyResult:
    """Empirical entropy (bits per drafted token) of `sequences`, and order-0..`orders` entropies.

    >>> r = empirical_entropy([[1, 2, 3, 1, 2, 4]])
    >>> round(r.entropy_bits, 4), [round(b, 4) for b in r.order_bits[:3]], r.num_contexts
    (0.2667, [1.9183, 0.4, 0.5], 15)
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)):
        raise EntropyError(f"max_depth must be an integer, got {max_depth!r}")
    if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
        raise EntropyError(f"max_depth must be in [1, {MAX_DEPTH_LIMIT}], got {max_depth}")
    if isinstance(orders, bool) or not isinstance(orders, (int, np.integer)):
        raise EntropyError(f"orders must be an integer, got {orders!r}")
    if not 0 <= orders <= MAX_DEPTH_LIMIT:
        raise EntropyError(f"orders must be in [0, {MAX_DEPTH_LIMIT}], got {orders}")
    max_depth, orders = int(max_depth), int(orders)
    arrays = [_check_sequence(seq, i) for i, seq in enumerate(sequences)]
    text = _concatenate(arrays)
    num_tokens = len(text) - sum(1 for a in arrays if len(a))
    depth = max(max_depth, orders)
    num_by_depth = np.zeros(depth + 1, dtype=np.float64)  # sum of n_c * H(next | c) per depth
    contexts_by_depth = np.zeros(depth + 1, dtype=np.int64)  # sum of n_c per depth
    if num_tokens:
        sa = build_suffix_array(text)
        _branching_sums(text, sa, depth, num_by_depth)
        _context_counts(text, depth, contexts_by_depth)
    num_contexts = int(contexts_by_depth[1 : max_depth + 1].sum())
    entropy = float(num_by_depth[1 : max_depth + 1].sum()) / num_contexts if num_contexts else 0.0
    order_bits = [
        max(0.0, float(num_by_depth[k]) / int(contexts_by_depth[k])) if contexts_by_depth[k] else math.nan
        for k in range(orders + 1)
    ]
    return EntropyResult(
        entropy_bits=max(0.0, entropy),  # f(m) - sum f(m_j) may round a hair below zero
        order_bits=order_bits,
        num_sequences=len(arrays),
        num_tokens=num_tokens,
        num_contexts=num_contexts,
        max_depth=max_depth,
    )


def _check_sequence(seq: np.ndarray | Sequence[int], i: int) -> np.ndarray:
    """One sequence as int32 token ids, or an EntropyError naming the sequence and the token."""
    if isinstance(seq, (str, bytes)):
        raise EntropyError(f"sequences[{i}] must be token ids, got {type(seq).__name__}")
    try:
        arr = seq if isinstance(seq, np.ndarray) else np.asarray(seq)
    except (TypeError, ValueError) as exc:  # ragged nesting and the like
        raise EntropyError(f"sequences[{i}] is not a flat sequence of token ids: {exc}") from None
    if arr.ndim != 1:
        raise EntropyError(f"sequences[{i}] must be a flat sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)  # np.asarray([]) is float64: emptiness is not a type error
    if arr.dtype.kind not in "iu":
        raise EntropyError(f"sequences[{i}] must hold integer token ids, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN:
        j = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN))[0])
        raise EntropyError(f"sequences[{i}][{j}] = {int(arr[j])} is out of range [0, {MAX_TOKEN}]")
    return arr.astype(np.int32, copy=False)


def _concatenate(arrays: list[np.ndarray]) -> np.ndarray:
    """The text: every non-empty sequence followed by SEP (empty ones add nothing to count)."""
    nonempty = [a for a in arrays if len(a)]
    text = np.full(sum(len(a) for a in nonempty) + len(nonempty), SEP, dtype=np.int32)
    pos = 0
    for a in nonempty:
        text[pos : pos + len(a)] = a
        pos += len(a) + 1
    return text


@njit(cache=True, nogil=True)
def _xlog2x(x: int) -> float:
    return x * math.log2(x) if x > 1 else 0.0


@njit(cache=True, nogil=True)
def _lcp(text: np.ndarray, a: int, b: int, cap: int) -> int:
    """Common real tokens at the start of suffixes a and b, at most `cap`; a SEP never matches."""
    h = 0
    while h < cap and text[a + h] == text[b + h] and text[a + h] != SEP:
        h += 1
    return h


@njit(cache=True, nogil=True)
def _branching_sums(text: np.ndarray, sa: np.ndarray, depth: int, out: np.ndarray) -> None:
    """Add n_c * H(next | c) of every context of length 0..depth into out[len(c)].

    Bottom-up traversal of the lcp-intervals (Abouelhoda, Kurtz, Ohlebusch 2004). Every lcp value
    is capped at depth + 1: the intervals deeper than that merge into one of lcp depth + 1, which
    has the same size (no branching in between) and is itself never scored, so the cap is exact;
    it also keeps every comparison within the SORT_DEPTH tokens the suffix array is sorted by.
    Suffixes that end (reach SEP) exactly at an interval's depth are its *ends*: occurrences not
    followed by a token, left out of n_c. They are singleton children (the lcp stops at SEP) and
    sort first among the children, because SEP is smaller than every token.
    """
    n = len(sa)
    cap = depth + 1
    stack_lcp = np.empty(cap + 2, dtype=np.int64)  # lcp values on the stack strictly increase
    stack_lb = np.empty(cap + 2, dtype=np.int64)
    stack_ends = np.empty(cap + 2, dtype=np.int64)
    top = 0
    stack_lcp[0], stack_lb[0], stack_ends[0] = 0, 0, 0  # the root: context of length 0
    for i in range(1, n + 1):
        h = _lcp(text, sa[i - 1], sa[i], cap) if i < n else -1  # -1 closes every interval
        # Leaf i-1 hangs from the deeper of the intervals on its two sides; top holds lcp[i-1].
        new_ends = 0
        if h <= stack_lcp[top]:
            if text[sa[i - 1] + stack_lcp[top]] == SEP:
                stack_ends[top] += 1
        elif text[sa[i - 1] + h] == SEP:
            new_ends = 1
        lb = i - 1
        while top >= 0 and h < stack_lcp[top]:
            ell = stack_lcp[top]
            size = i - stack_lb[top]
            if ell <= depth:
                out[ell] += _xlog2x(size - stack_ends[top])
            lb = stack_lb[top]
            top -= 1
            parent = h
            if top >= 0 and stack_lcp[top] > parent:
                parent = stack_lcp[top]
            if 0 <= parent <= depth:
                out[parent] -= _xlog2x(size)
        if h >= 0 and (top < 0 or h > stack_lcp[top]):
            top += 1
            stack_lcp[top], stack_lb[top], stack_ends[top] = h, lb, new_ends


@njit(cache=True, nogil=True)
def _context_counts(text: np.ndarray, depth: int, out: np.ndarray) -> None:
    """out[d] += number of positions followed by at least d more tokens of the same sequence.

    out[0] counts every token (the unigram positions); for d >= 1, out[d] is sum_{|c|=d} n_c.
    """
    hist = np.zeros(depth + 2, dtype=np.int64)  # hist[r] = positions with min(r, depth + 1) tokens after
    after = -1
    for p in range(len(text) - 1, -1, -1):
        if text[p] == SEP:
            after = -1
            continue
        after += 1
        hist[min(after, depth + 1)] += 1
    acc = 0
    for d in range(depth + 1, -1, -1):
        acc += hist[d]
        if d <= depth:
            out[d] += acc
