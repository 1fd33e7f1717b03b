"""The prefix array of a live sequence (the request index: prompt + output so far), which grows at
its end. Appending a token to the text only adds one *prefix*, so its index is a prefix array: end
positions sorted by the text read backwards from them (first `depth` tokens; ties by position). An
append is one binary search and one shift, and matching the context's last p tokens narrows the
same range as p grows. The sealed text's suffix array is core/index/suffix_array.py's.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import configure as configure_numba_cache
from .suffix_array import SEP, build_suffix_array

configure_numba_cache()  # before any kernel here is decorated


@njit(cache=True, nogil=True)
def _backward_less(tokens: np.ndarray, e1: int, e2: int, depth: int) -> bool:
    for k in range(depth):
        a = tokens[e1 - k] if e1 - k >= 0 else SEP
        b = tokens[e2 - k] if e2 - k >= 0 else SEP
        if a != b:
            return a < b
        if a == SEP:
            break
    return e1 < e2


def prefix_array_build(tokens: np.ndarray) -> np.ndarray:
    """The prefix array of `tokens` in one sort: the suffix array of the reversed text.

    Its order refines the one prefix_array_extend keeps (backward tokens to `depth`, then
    position), so later appends insert into it correctly.
    """
    n = len(tokens)
    reversed_text = np.empty(n + 1, dtype=np.int32)
    reversed_text[:n] = tokens[::-1]
    reversed_text[n] = SEP
    return (n - 1 - build_suffix_array(reversed_text)).astype(np.int32)


@njit(cache=True, nogil=True)
def prefix_array_extend(tokens: np.ndarray, pa: np.ndarray, start: int, stop: int, depth: int) -> None:
    """Insert end positions start..stop-1 of `tokens` into `pa` (which holds 0..start-1, sorted)."""
    for e in range(start, stop):
        a, b = 0, e
        while a < b:
            m = (a + b) >> 1
            if _backward_less(tokens, pa[m], e, depth):
                a = m + 1
            else:
                b = m
        for j in range(e, a, -1):
            pa[j] = pa[j - 1]
        pa[a] = e


@njit(cache=True, nogil=True, inline="always")
def prefix_narrow(tokens: np.ndarray, pa: np.ndarray, base: int, lo: int, hi: int, k: int, token: int) -> tuple[int, int]:
    """Sub-range of pa[lo:hi] (equal on backward tokens 0..k-1) whose backward token k is `token`,
    for the sequence at offset `base` of `tokens` and `pa` (an arena: no view is made, no reference
    counted, in the drafting kernel's innermost loop)."""
    a, b = lo, hi
    while a < b:
        m = (a + b) >> 1
        e = pa[base + m]
        if (tokens[base + e - k] if e - k >= 0 else SEP) < token:
            a = m + 1
        else:
            b = m
    start = a
    b = hi
    while a < b:
        m = (a + b) >> 1
        e = pa[base + m]
        if (tokens[base + e - k] if e - k >= 0 else SEP) <= token:
            a = m + 1
        else:
            b = m
    return start, a
