"""The compiled drafting kernel: match the context's suffix, grow a draft tree best-first by D(N).

One call drafts from one index. An index is seen here as two kinds of parts, queried together so
that every count is exact over the whole index:
- sealed segments: suffix-array blocks of one shared text; a node is a range in each block;
- live sequences: regions of one token arena plus their prefix arrays (a parallel arena); a node
  is a list of occurrence starts.

Notation (docs/design.md, "The method"): COUNT(N) = occurrences of N's string; C(N) = COUNT(N) /
COUNT(parent); D(N) = product of C from the matched node N_p down to N; SCORE = sum of D.
Children of a node are pushed in order of count (descending), then token id, each with a
sequence number, and the heap pops the highest D first and the lowest sequence number among equal
D: the integer tie-break that makes drafts deterministic.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..numba_cache import configure as configure_numba_cache
from .children import children_bound, node_children_into
from .prefix_array import prefix_narrow
from .suffix_array import forward_ranges_into

configure_numba_cache()  # before any kernel here is decorated


@njit(cache=True, nogil=True, inline="always")
def _grow1(a: np.ndarray, n: int) -> np.ndarray:
    if n <= len(a):
        return a
    b = np.empty(max(n, 2 * len(a)), dtype=a.dtype)
    b[: len(a)] = a
    return b


@njit(cache=True, nogil=True, inline="always")
def _grow2(a: np.ndarray, n: int) -> np.ndarray:
    if n <= a.shape[0]:
        return a
    b = np.empty((max(n, 2 * a.shape[0]), a.shape[1]), dtype=a.dtype)
    b[: a.shape[0]] = a
    return b


@njit(cache=True, nogil=True, inline="always")
def _heap_push(hd, hs, hn, size, d, seq, node):
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if hd[parent] > d or (hd[parent] == d and hs[parent] < seq):
            break
        hd[i] = hd[parent]
        hs[i] = hs[parent]
        hn[i] = hn[parent]
        i = parent
    hd[i] = d
    hs[i] = seq
    hn[i] = node


@njit(cache=True, nogil=True, inline="always")
def _heap_pop(hd, hs, hn, size):
    """Remove the top of a heap of `size` items; returns its node."""
    top = hn[0]
    size -= 1
    d = hd[size]
    s = hs[size]
    n = hn[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and (hd[c + 1] > hd[c] or (hd[c + 1] == hd[c] and hs[c + 1] < hs[c])):
            c += 1
        if d > hd[c] or (d == hd[c] and s < hs[c]):
            break
        hd[i] = hd[c]
        hs[i] = hs[c]
        hn[i] = hn[c]
        i = c
    hd[i] = d
    hs[i] = s
    hn[i] = n
    return top


WS_CAP = 64  # draft nodes the workspaces hold before they grow
SPEC_SLACK = 1e-6  # MAX_SPEC(p) = floor(alpha * p): the slack keeps 0.29 * 100 = 28.999... from flooring to 28


@njit(cache=True, nogil=True, inline="always")
def expand(text, sa, root_flo, root_fhi, live_tok, live_base, live_len, root_doc, root_start, match_len,
           root_count, max_spec, min_prob, tree, block, fblock, iblock, occ_doc, occ_start):
    """Grow the draft below the matched node N_p (depth match_len). Returns tokens, parents, probs, score
    (views of the workspaces: copy them before the next call).

    Workspaces, allocated once per speculate_index call (allocation and reference counting were a
    third of a draft's time): int64 `block` of at least WS_CAP * (13 + 4 * segments) + 2 *
    max(len(root_doc), 1), float64 `fblock` of 2 * WS_CAP + max_spec, int32 `iblock` of 2 *
    max_spec, int64 `occ_doc`/`occ_start` of at least len(root_doc). Arrays that outgrow their
    piece are replaced by their own (see _grow1, _grow2).
    """
    num_segs = len(root_flo)
    cap = WS_CAP
    num_occ = len(root_doc)
    occ_cap = max(num_occ, 1)
    rows = block[: 13 * cap].reshape((13, cap))  # 13 arrays of one node (or candidate) each
    nd_depth, nd_count, nd_tok, nd_parent, nd_olo, nd_ohi = rows[0], rows[1], rows[2], rows[3], rows[4], rows[5]
    hs, hn, ws_cand, tok, cnt, lbeg, lend = rows[6], rows[7], rows[8], rows[9], rows[10], rows[11], rows[12]
    # nd_parent: draft index of the parent, -1 under N_p
    at = cap * (13 + 4 * num_segs)
    grids = block[13 * cap : at].reshape((4, cap, num_segs))  # a range per sealed segment, per node
    nd_flo, nd_fhi, flo, fhi = grids[0], grids[1], grids[2], grids[3]
    ws_next = block[at : at + occ_cap]  # a node's live occurrences never outnumber N_p's
    ws_idx = block[at + occ_cap : at + 2 * occ_cap]
    nd_d = fblock[:cap]
    hd = fblock[cap : 2 * cap]
    out_prob = fblock[2 * cap :]
    out_tok = iblock[: max(max_spec, 0)]
    out_par = iblock[max(max_spec, 0) : 2 * max(max_spec, 0)]
    occ_doc[:num_occ] = root_doc
    occ_start[:num_occ] = root_start
    # Node 0 is N_p itself.
    nd_depth[0] = match_len
    nd_count[0] = root_count
    nd_d[0] = 1.0
    nd_tok[0] = -1
    nd_parent[0] = -1
    nd_flo[0] = root_flo
    nd_fhi[0] = root_fhi
    nd_olo[0] = 0
    nd_ohi[0] = num_occ
    num_nodes = 1
    num_out = 0
    score = 0.0
    heap_size = 0
    seq = 0
    u = 0  # node whose children come next
    u_draft = -1
    while num_out < max_spec:
        need = min_prob * nd_count[u] / nd_d[u]
        bound = children_bound(nd_flo[u], nd_fhi[u], nd_ohi[u] - nd_olo[u], need / nd_count[u])
        if bound > len(ws_cand):
            ws_cand = np.empty(2 * bound, dtype=np.int64)
            tok = np.empty(2 * bound, dtype=np.int64)
            cnt = np.empty(2 * bound, dtype=np.int64)
            flo = np.empty((2 * bound, num_segs), dtype=np.int64)
            fhi = np.empty((2 * bound, num_segs), dtype=np.int64)
            lbeg = np.empty(2 * bound, dtype=np.int64)
            lend = np.empty(2 * bound, dtype=np.int64)
        nk = node_children_into(text, sa, nd_flo[u], nd_fhi[u], live_tok, live_base, live_len, occ_doc, occ_start,
                       nd_olo[u], nd_ohi[u], nd_depth[u], nd_count[u], need, ws_cand, ws_next, ws_idx,
                       tok, cnt, flo, fhi, lbeg, lend)
        live_idx = ws_idx
        if not tree and nk > 1:
            nk = 1  # path mode: follow the most frequent child only
        for c in range(nk):
            d = nd_d[u] * (cnt[c] / nd_count[u])
            if d < min_prob:
                continue
            v = num_nodes
            num_nodes += 1
            if num_nodes > len(nd_depth):
                n2 = num_nodes
                nd_depth = _grow1(nd_depth, n2)
                nd_count = _grow1(nd_count, n2)
                nd_d = _grow1(nd_d, n2)
                nd_tok = _grow1(nd_tok, n2)
                nd_parent = _grow1(nd_parent, n2)
                nd_flo = _grow2(nd_flo, n2)
                nd_fhi = _grow2(nd_fhi, n2)
                nd_olo = _grow1(nd_olo, n2)
                nd_ohi = _grow1(nd_ohi, n2)
            nd_depth[v] = nd_depth[u] + 1
            nd_count[v] = cnt[c]
            nd_d[v] = d
            nd_tok[v] = tok[c]
            nd_parent[v] = u_draft
            nd_flo[v] = flo[c]
            nd_fhi[v] = fhi[c]
            occ_doc = _grow1(occ_doc, num_occ + lend[c] - lbeg[c])
            occ_start = _grow1(occ_start, num_occ + lend[c] - lbeg[c])
            nd_olo[v] = num_occ
            for i in range(lbeg[c], lend[c]):
                occ_doc[num_occ] = occ_doc[live_idx[i]]
                occ_start[num_occ] = occ_start[live_idx[i]]
                num_occ += 1
            nd_ohi[v] = num_occ
            if heap_size + 1 > len(hd):
                hd = _grow1(hd, heap_size + 1)
                hs = _grow1(hs, heap_size + 1)
                hn = _grow1(hn, heap_size + 1)
            _heap_push(hd, hs, hn, heap_size, d, seq, v)
            heap_size += 1
            seq += 1
        if heap_size == 0:
            break
        v = _heap_pop(hd, hs, hn, heap_size)
        heap_size -= 1
        out_tok[num_out] = nd_tok[v]
        out_par[num_out] = nd_parent[v]
        out_prob[num_out] = nd_d[v]
        score += nd_d[v]
        u = v
        u_draft = num_out
        num_out += 1
    return out_tok[:num_out], out_par[:num_out], out_prob[:num_out], score


@njit(cache=True, nogil=True)
def speculate_index(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, live_tok, live_pa, live_base,
                    live_len, context,
                    max_depth, max_spec_tokens, alpha, min_prob, tree, floor_score, floor_len,
                    out_tok, out_par, out_prob):
    """Best draft from one index over match lengths p = 1..P, if it beats (floor_score, floor_len).

    Writes the draft into out_tok/out_par/out_prob (room for max_spec_tokens) and returns
    (num_tokens, score, match_len, improved): scalars only, as boxing arrays costs microseconds
    per call. Candidates are compared by
    score, then by match length (longer wins a tie), as in the reference implementation. p runs
    from the longest match down, and stops once no shorter match can win: a draft from match
    length p has at most MAX_SPEC(p) nodes, each with D <= 1.
    """
    num_live = len(live_len)
    t = len(context)
    max_p = min(max_depth, t)
    # Live parts: the prefix array narrows as the matched suffix grows by one token (leftwards).
    live_lo = np.zeros((max_p + 1, num_live), dtype=np.int64)
    live_hi = np.zeros((max_p + 1, num_live), dtype=np.int64)
    for j in range(num_live):
        live_hi[0, j] = live_len[j]
    live_pmax = 0
    for p in range(1, max_p + 1):
        tok = context[t - p]
        found = False
        for j in range(num_live):
            base = live_base[j]
            a, b = prefix_narrow(live_tok, live_pa, base, live_lo[p - 1, j], live_hi[p - 1, j], p - 1, tok)
            live_lo[p, j] = a
            live_hi[p, j] = b
            if b > a:
                found = True
        if not found:
            break
        live_pmax = p
    # Workspaces for every match length tried (see expand): one allocation each, not per length.
    num_segs = len(seg_lo)
    occ_max = 1  # live occurrences of N_1, the most any N_p has
    if live_pmax >= 1:
        for j in range(num_live):
            occ_max += live_hi[1, j] - live_lo[1, j]
    block = np.empty(WS_CAP * (13 + 4 * num_segs) + 2 * occ_max, dtype=np.int64)
    fblock = np.empty(2 * WS_CAP + max_spec_tokens, dtype=np.float64)
    iblock = np.empty(2 * max_spec_tokens, dtype=np.int32)
    occ = np.empty(4 * occ_max, dtype=np.int64)
    occ_doc = occ[: 2 * occ_max]  # grown by expand when its nodes' occurrences need more
    occ_start = occ[2 * occ_max :]
    roots = np.empty(2 * occ_max, dtype=np.int64)
    flo = np.empty(num_segs, dtype=np.int64)
    fhi = np.empty(num_segs, dtype=np.int64)
    # Sealed parts: the longest p that occurs, by galloping then bisection (occurrence is monotone).
    fwd_pmax = 0
    if len(seg_lo) > 0:
        good = 0
        bad = max_p + 1
        p = 1
        while p <= max_p:
            total = forward_ranges_into(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, context[t - p:], flo, fhi)
            if total > 0:
                good = p
                p *= 2
            else:
                bad = p
                break
        if good == max_p:
            bad = max_p + 1
        elif bad > max_p:
            bad = max_p + 1
        while bad - good > 1:
            mid = (good + bad) // 2
            total = forward_ranges_into(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, context[t - mid:], flo, fhi)
            if total > 0:
                good = mid
            else:
                bad = mid
        fwd_pmax = good
    num_best = 0
    best_score = floor_score
    best_len = floor_len
    improved = False
    longer_count = -1  # COUNT(N_{p+1}) when p+1 was considered
    for p in range(max(live_pmax, fwd_pmax), 0, -1):
        max_spec = min(max_spec_tokens, int(p * alpha + SPEC_SLACK))
        if max_spec < 0:
            max_spec = 0
        if best_score > max_spec or (best_score == max_spec and best_len >= p):
            break
        pattern = context[t - p:]
        if p <= fwd_pmax:
            count = forward_ranges_into(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pattern, flo, fhi)
        else:
            flo[:] = seg_lo
            fhi[:] = seg_lo
            count = 0
        num_occ = 0
        if p <= live_pmax:
            for j in range(num_live):
                num_occ += live_hi[p, j] - live_lo[p, j]
        # Equal counts mean N_p's occurrences are exactly N_{p+1}'s, so its subtree is the same
        # and its budget no larger: it cannot beat p+1, which was already weighed. Exact skip.
        same = count + num_occ == longer_count
        longer_count = count + num_occ
        if same:
            continue
        root_doc = roots[:num_occ]
        root_start = roots[occ_max : occ_max + num_occ]
        if p <= live_pmax:
            i = 0
            for j in range(num_live):
                base = live_base[j]
                for r in range(live_lo[p, j], live_hi[p, j]):
                    root_doc[i] = j
                    root_start[i] = live_pa[base + r] - p + 1
                    i += 1
        count += num_occ
        if count == 0:
            continue
        tok, par, prob, score = expand(text, sa, flo, fhi, live_tok, live_base, live_len, root_doc, root_start,
                                       p, count, max_spec, min_prob, tree, block, fblock, iblock, occ_doc, occ_start)
        if score > best_score or (score == best_score and p > best_len):
            num_best = len(tok)
            out_tok[:num_best] = tok
            out_par[:num_best] = par
            out_prob[:num_best] = prob
            best_score = score
            best_len = p
            improved = True
    return num_best, best_score, best_len, improved
