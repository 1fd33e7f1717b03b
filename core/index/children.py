"""The children of a draft-tree node, over every part of an index (compiled).

A node is a range in each sealed segment's suffix array plus a list of occurrence starts in the
live sequences. Its children are the next tokens, with their counts summed over all parts; only
those a draft can use (count >= need, from min_token_prob) are wanted, and the worked-out probe
stride finds them without scanning whole ranges.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import configure as configure_numba_cache
from .suffix_array import SEP, narrow

configure_numba_cache()  # before any kernel here is decorated

_EPS = 1e-9


@njit(cache=True, nogil=True, inline="always")
def children_bound(flo, fhi, num_occ, frac):
    """How many candidates `_children` can see: the workspace size it needs."""
    bound = num_occ
    for k in range(len(flo)):
        w = fhi[k] - flo[k]
        if w > 0:
            stride = max(1, int(frac * w * (1.0 - _EPS)))
            bound += min(w, w // stride + 1)
    return bound


@njit(cache=True, nogil=True)
def _sort_pairs(keys, vals, n):
    """Sort keys[:n] ascending carrying vals; keys and vals are non-negative int32 values and vals
    come ascending, so sorting by (key, val) is the stable sort."""
    if n > 16:  # one sort of packed (key, val) pairs: vals are ascending here, so the order is stable
        packed = np.empty(n, dtype=np.int64)
        for i in range(n):
            packed[i] = (keys[i] << 32) | vals[i]
        packed.sort()
        for i in range(n):
            keys[i] = packed[i] >> 32
            vals[i] = packed[i] & 0xFFFFFFFF
        return
    for i in range(1, n):
        k = keys[i]
        v = vals[i]
        j = i - 1
        while j >= 0 and keys[j] > k:
            keys[j + 1] = keys[j]
            vals[j + 1] = vals[j]
            j -= 1
        keys[j + 1] = k
        vals[j + 1] = v


@njit(cache=True, nogil=True, inline="always")
def node_children_into(text, sa, flo, fhi, live_tok, live_base, live_len, occ_doc, occ_start, olo, ohi, depth, count,
              need, ws_cand, ws_next, ws_idx, ch_tok, ch_cnt, ch_flo, ch_fhi, ch_lbeg, ch_lend):
    """Children of a node (total `count`) with count >= `need`, written into the ch_* arrays.

    Returns how many. They come sorted by count desc, then token asc; ch_lbeg/ch_lend index
    ws_idx, which lists the node's live occurrences grouped by next token. A child holding at
    least need/count of the node's occurrences overall holds at least that share in some part, so
    probing each sealed range at that stride finds every candidate. The caller sizes the
    workspaces with `_children_bound`.
    """
    num_segs = len(flo)
    frac = need / count
    num_cand = 0
    slack = 0  # a token missed by every probe has fewer than this many sealed occurrences
    for k in range(num_segs):
        lo = flo[k]
        hi = fhi[k]
        w = hi - lo
        if w <= 0:
            continue
        stride = max(1, int(frac * w * (1.0 - _EPS)))
        slack += stride - 1
        pos = lo
        while pos < hi:
            tok = text[sa[pos] + depth]
            a, b = narrow(text, sa, pos, hi, depth, tok)
            if tok != SEP:
                ws_cand[num_cand] = tok
                num_cand += 1
            # Jump past this token's run to the next probe position.
            nxt = pos + stride
            if b > nxt:
                nxt = lo + ((b - lo + stride - 1) // stride) * stride
            pos = nxt
    # Live occurrences: every next token, grouped (stable, so occurrence order is kept).
    m = 0
    for i in range(olo, ohi):
        d = occ_doc[i]
        p = occ_start[i] + depth
        if p < live_len[d]:
            ws_next[m] = live_tok[live_base[d] + p]
            ws_idx[m] = i
            m += 1
    _sort_pairs(ws_next, ws_idx, m)
    i = 0
    while i < m:
        j = i
        while j < m and ws_next[j] == ws_next[i]:
            j += 1
        if (j - i) + slack >= need * (1.0 - _EPS):
            ws_cand[num_cand] = ws_next[i]
            num_cand += 1
        i = j
    # Unique candidates, ascending.
    cand = ws_cand[:num_cand]
    cand.sort()
    kept = 0
    prev = -2
    for c in range(num_cand):
        tok = cand[c]
        if tok == prev:
            continue
        prev = tok
        total = 0
        for k in range(num_segs):
            if fhi[k] > flo[k]:
                a, b = narrow(text, sa, flo[k], fhi[k], depth, tok)
            else:
                a, b = flo[k], flo[k]
            ch_flo[kept, k] = a
            ch_fhi[kept, k] = b
            total += b - a
        a = np.searchsorted(ws_next[:m], tok, side="left")
        b = np.searchsorted(ws_next[:m], tok, side="right")
        total += b - a
        if total > 0 and total >= need * (1.0 - _EPS):
            ch_tok[kept] = tok
            ch_cnt[kept] = total
            ch_lbeg[kept] = a
            ch_lend[kept] = b
            kept += 1
    # Count desc, token asc: a stable insertion sort on -count (kept is small).
    for i in range(1, kept):
        j = i
        while j > 0 and ch_cnt[j - 1] < ch_cnt[j]:
            for arr in (ch_tok, ch_cnt, ch_lbeg, ch_lend):
                arr[j - 1], arr[j] = arr[j], arr[j - 1]
            for k in range(num_segs):
                ch_flo[j - 1, k], ch_flo[j, k] = ch_flo[j, k], ch_flo[j - 1, k]
                ch_fhi[j - 1, k], ch_fhi[j, k] = ch_fhi[j, k], ch_fhi[j - 1, k]
            j -= 1
    return kept


@njit(cache=True, nogil=True)
def node_children(text, sa, flo, fhi, live_tok, live_base, live_len, occ_doc, occ_start, depth, count):
    """Every child of a node as (tokens, counts), token-ascending: the index's `children` query."""
    num_occ = len(occ_doc)
    bound = max(children_bound(flo, fhi, num_occ, 0.0), 1)
    num_segs = len(flo)
    ws_next = np.empty(max(num_occ, 1), dtype=np.int64)
    ws_idx = np.empty(max(num_occ, 1), dtype=np.int64)
    tok = np.empty(bound, dtype=np.int64)
    cnt = np.empty(bound, dtype=np.int64)
    nk = node_children_into(text, sa, flo, fhi, live_tok, live_base, live_len, occ_doc, occ_start, 0, num_occ, depth,
                   count, 0.0, np.empty(bound, dtype=np.int64), ws_next, ws_idx, tok, cnt,
                   np.empty((bound, num_segs), dtype=np.int64), np.empty((bound, num_segs), dtype=np.int64),
                   np.empty(bound, dtype=np.int64), np.empty(bound, dtype=np.int64))
    order = np.argsort(tok[:nk])
    return tok[:nk][order], cnt[:nk][order]
