"""Suffix array construction and the compiled search primitives of the suffix index.

A text here is many documents concatenated, each followed by a separator token `SEP` (-1), which
sorts before every real token. Patterns never contain `SEP`, so no match crosses a document
boundary, and the suffix array lists only positions that hold a real token.

Worked example: documents [1,2,3,1,2,4] -> text [1,2,3,1,2,4,-1]; suffixes sorted:
  [1,2,3,1,2,4,-1] (0), [1,2,4,-1] (3), [2,3,...] (1), [2,4,-1] (4), [3,...] (2), [4,-1] (5)
so sa = [0, 3, 1, 4, 2, 5]. Pattern [1,2] is the range sa[0:2] (count 2); its children are split
by the token at depth 2: {3: 1, 4: 1}.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import configure as configure_numba_cache

configure_numba_cache()  # before any kernel here is decorated

SEP = -1
# Suffixes are ordered by their first SORT_DEPTH tokens only (ties keep text order). Every query
# looks at most max_depth + max_spec_tokens tokens deep, which the index checks against this bound;
# the cap keeps highly repetitive text (the same output logged many times) from costing
# log2(longest repeat) sorting rounds.
SORT_DEPTH = 1024


SMALL_TEXT = 1 << 14  # below this, one compiled call beats dozens of numpy calls per round


def build_suffix_array(text: np.ndarray) -> np.ndarray:
    """Suffix array of `text` (int32, documents separated by SEP) without the SEP positions.

    Prefix doubling in the style of Larsson-Sadakane: each round sorts only the suffixes whose
    group (equal first h tokens) is not yet a singleton, so repetitive text costs little more
    than rounds over its repeated parts. Ties beyond SORT_DEPTH keep text order. Small texts (a
    finished request added online) go through a compiled version of the same algorithm, which
    gives the same array.
    """
    n = len(text)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    text = np.ascontiguousarray(text, dtype=np.int32)
    if n < SMALL_TEXT:
        return _build_small(text)
    # Round 0: order by the first two tokens, packed into one int64 key.
    nxt = np.empty(n, dtype=np.int64)
    nxt[:-1] = text[1:]
    nxt[-1] = SEP - 1  # past the end: smaller than SEP
    key = (text.astype(np.int64) + 2) * (1 << 32) + (nxt + 2)
    sa = np.argsort(key, kind="stable").astype(np.int64)
    rank, open_pos = _group_ranks(key[sa], sa, n)
    h = 2
    while len(open_pos) > 0 and h < SORT_DEPTH:
        members = sa[open_pos]
        group = rank[members]  # group start position in sa: orders groups
        second = np.full(len(members), -1, dtype=np.int64)
        inside = members + h < n
        second[inside] = rank[members[inside] + h]
        sub_key = group * (n + 1) + (second + 1)
        order = np.argsort(sub_key, kind="stable")
        members = members[order]
        sub_key = sub_key[order]
        sa[open_pos] = members
        new_start = np.ones(len(members), dtype=bool)
        new_start[1:] = sub_key[1:] != sub_key[:-1]
        starts = np.where(new_start, open_pos, 0)
        np.maximum.accumulate(starts, out=starts)
        rank[members] = starts
        # A member stays open while its new group has another member.
        size_next = np.zeros(len(members), dtype=bool)
        size_next[:-1] = ~new_start[1:]
        size_prev = ~new_start
        still = size_next | size_prev
        open_pos = open_pos[still]
        h *= 2
    keep = text[sa] != SEP
    return sa[keep].astype(np.int32)


@njit(cache=True, nogil=True)
def _build_small(text: np.ndarray) -> np.ndarray:
    """The algorithm of build_suffix_array, compiled: for short texts (no per-call numpy overhead)."""
    n = len(text)
    key = np.empty(n, dtype=np.int64)
    for i in range(n):
        nxt = text[i + 1] if i + 1 < n else SEP - 1
        key[i] = (np.int64(text[i]) + 2) * (1 << 32) + (nxt + 2)
    sa = np.argsort(key, kind="mergesort")
    rank = np.empty(n, dtype=np.int64)  # sa position where the suffix's group starts
    open_pos = np.empty(n, dtype=np.int64)  # sa positions of suffixes in groups of two or more
    num_open = 0
    j = 0
    while j < n:
        k = j
        while k + 1 < n and key[sa[k + 1]] == key[sa[j]]:
            k += 1
        for m in range(j, k + 1):
            rank[sa[m]] = j
            if k > j:
                open_pos[num_open] = m
                num_open += 1
        j = k + 1
    h = 2
    sub_key = np.empty(n, dtype=np.int64)
    members = np.empty(n, dtype=np.int64)
    while num_open > 0 and h < SORT_DEPTH:
        # Sort the open suffixes by (group, rank h tokens on); groups are contiguous, so the
        # combined key keeps them apart. Keys read the ranks of the previous round.
        for t in range(num_open):
            m = sa[open_pos[t]]
            members[t] = m
            sub_key[t] = rank[m] * (n + 1) + (rank[m + h] + 1 if m + h < n else 0)
        order = np.argsort(sub_key[:num_open], kind="mergesort")
        for t in range(num_open):
            sa[open_pos[t]] = members[order[t]]
        still = 0
        t = 0
        while t < num_open:
            u = t
            while u + 1 < num_open and sub_key[order[u + 1]] == sub_key[order[t]]:
                u += 1
            start = open_pos[t]  # read before the compaction below overwrites it
            for v in range(t, u + 1):
                rank[members[order[v]]] = start
                if u > t:
                    open_pos[still] = open_pos[v]
                    still += 1
            t = u + 1
        num_open = still
        h *= 2
    out = np.empty(n, dtype=np.int32)
    m = 0
    for j in range(n):
        if text[sa[j]] != SEP:
            out[m] = sa[j]
            m += 1
    return out[:m]


def _group_ranks(sorted_key: np.ndarray, sa: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank each suffix by the sa position where its group starts; list the open positions."""
    new_start = np.ones(n, dtype=bool)
    new_start[1:] = sorted_key[1:] != sorted_key[:-1]
    starts = np.where(new_start, np.arange(n), 0)
    np.maximum.accumulate(starts, out=starts)
    rank = np.empty(n, dtype=np.int64)
    rank[sa] = starts
    size_next = np.zeros(n, dtype=bool)
    size_next[:-1] = ~new_start[1:]
    open_mask = size_next | ~new_start
    return rank, np.flatnonzero(open_mask)


@njit(cache=True, nogil=True, inline="always")
def narrow(text: np.ndarray, sa: np.ndarray, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
    """Sub-range of sa[lo:hi] (suffixes equal on their first `depth` tokens) with `token` at `depth`.

    Every suffix in range has `depth` real tokens, so text[sa[m] + depth] is at worst the SEP that
    ends its document: never out of bounds.
    """
    a, b = lo, hi
    while a < b:
        m = (a + b) >> 1
        if text[sa[m] + depth] < token:
            a = m + 1
        else:
            b = m
    start = a
    b = hi
    while a < b:
        m = (a + b) >> 1
        if text[sa[m] + depth] <= token:
            a = m + 1
        else:
            b = m
    return start, a


@njit(cache=True, nogil=True)
def pattern_range(text: np.ndarray, sa: np.ndarray, lo: int, hi: int, pattern: np.ndarray) -> tuple[int, int]:
    """The range of sa[lo:hi] whose suffixes start with `pattern`."""
    for k in range(len(pattern)):
        if lo >= hi:
            break
        lo, hi = narrow(text, sa, lo, hi, k, pattern[k])
    return lo, hi


@njit(cache=True, nogil=True)
def first_out_of_range(tokens: np.ndarray, limit: int) -> int:
    """Index of the first token outside [0, limit], or -1: one pass, for validating hot inputs."""
    for i in range(len(tokens)):
        if tokens[i] < 0 or tokens[i] > limit:
            return i
    return -1


SCAN_WIDTH = 8  # a range this narrow is checked suffix by suffix: sequential reads beat binary searches


@njit(cache=True, nogil=True, inline="always")
def scan_rest(text, sa, lo, hi, depth, pattern):
    """Sub-range of sa[lo:hi] (equal on `depth` tokens) whose suffixes go on with pattern[depth:].

    Those suffixes are contiguous (the range is sorted), and each check reads consecutive tokens;
    a suffix that ends (SEP) mismatches before anything past its document is read.
    """
    new_lo = hi
    new_hi = hi
    for i in range(lo, hi):
        pos = sa[i]
        ok = True
        for e in range(depth, len(pattern)):
            if text[pos + e] != pattern[e]:
                ok = False
                break
        if ok:
            if new_lo == hi:
                new_lo = i
            new_hi = i + 1
    if new_lo == hi:
        return lo, lo
    return new_lo, new_hi


@njit(cache=True, nogil=True)
def forward_ranges(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pattern):
    """Each sealed segment's range for `pattern`, and their total width."""
    flo = np.empty(len(seg_lo), dtype=np.int64)
    fhi = np.empty(len(seg_lo), dtype=np.int64)
    total = forward_ranges_into(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pattern, flo, fhi)
    return flo, fhi, total


@njit(cache=True, nogil=True)
def forward_ranges_into(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pattern, flo, fhi):
    """Each sealed segment's range for `pattern` into flo/fhi; returns their total width.

    A large segment has a first-token bucket table (seg_bucket >= 0): the range of the pattern's
    first token is two reads instead of two binary searches over the whole segment, the searches
    that miss the cache most.
    """
    num_segs = len(seg_lo)
    total = 0
    for k in range(num_segs):
        lo = seg_lo[k]
        hi = seg_hi[k]
        first = 0
        if seg_bucket[k] >= 0 and len(pattern) > 0:
            tok = pattern[0]
            if tok < seg_vocab[k]:
                lo = buckets[seg_bucket[k] + tok]
                hi = buckets[seg_bucket[k] + tok + 1]
            else:
                hi = lo
            first = 1
        for d in range(first, len(pattern)):
            if lo >= hi:
                break
            if hi - lo <= SCAN_WIDTH:
                lo, hi = scan_rest(text, sa, lo, hi, d, pattern)
                break
            lo, hi = narrow(text, sa, lo, hi, d, pattern[d])
        flo[k] = lo
        fhi[k] = hi
        total += hi - lo
    return total
