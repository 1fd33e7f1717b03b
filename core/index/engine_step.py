"""One compiled call per request per engine step: the tokens the model produced go into both
indexes, a path is drawn from each, and the better one comes back.

An engine that verifies linear drafts (vLLM v1) asks for one draft per request per step, and its
budget for that is tens of microseconds. Done as separate calls (check the tokens, append to the
request index, append to the global index, draft from each, merge the two in Python) the glue
costs more than the drafting. Here the appends and both drafts are one kernel call; Python keeps
only what must be Python: room for the appends (a live region that is full moves, see
core.index.live) and the Draft handed back.

The result equals SuffixCache's general path, `mine.better_path(other)` of the two indexes'
paths (tests/test_vllm_drafter.py checks them against each other).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..draft import Draft
from ..numba_cache import configure as configure_numba_cache
from .expand import speculate_index
from .prefix_array import prefix_array_extend
from .suffix_index import SuffixIndex
from .tokens import MAX_TOKEN, SuffixIndexError

configure_numba_cache()  # before any kernel here is decorated


@njit(cache=True, nogil=True)
def _append_live(live_tok, live_pa, live_base, live_len, slot, new, max_depth):
    base = live_base[slot]
    n = live_len[slot]
    m = len(new)
    for i in range(m):
        live_tok[base + n + i] = new[i]
    prefix_array_extend(live_tok[base:], live_pa[base:], n, n + m, max_depth)
    live_len[slot] = n + m


@njit(cache=True, nogil=True)
def append_and_draft(r_live_tok, r_live_pa, r_live_base, r_live_len, r_slot, r_cap, r_max_depth,
                     g_text, g_sa, g_seg_lo, g_seg_hi, g_seg_bucket, g_seg_vocab, g_buckets, g_live_tok, g_live_pa,
                     g_live_base, g_live_len, g_slot, g_cap, g_max_depth, vocab_limit,
                     new, context, max_spec_tokens, alpha, min_prob, out_tok, out_prob):
    """Append `new` to live sequence r_slot of the request index and g_slot of the global index (-1:
    none, -2: no global index), whose regions hold r_cap and g_cap tokens, then draft a path from
    each and keep the better (Draft.better_path). A request index has live sequences only: its
    sealed arrays, always empty, are not passed (each array argument costs the call its unboxing).

    `new` comes checked (SuffixCache.add_active_response); `context` is checked here.

    Returns (num_tokens, score, match_len) with the path in out_tok/out_prob; num_tokens is -1 when
    a context token is outside [0, vocab_limit], -2 when a region lacks room for `new` (nothing is
    appended then).
    """
    for i in range(len(context)):
        if context[i] < 0 or context[i] > vocab_limit:
            return -1, 0.0, 0
    if len(new) and (r_live_len[r_slot] + len(new) > r_cap or (g_slot >= 0 and g_live_len[g_slot] + len(new) > g_cap)):
        return -2, 0.0, 0
    if len(new):
        _append_live(r_live_tok, r_live_pa, r_live_base, r_live_len, r_slot, new, r_max_depth)
    if g_slot >= 0 and len(new):
        _append_live(g_live_tok, g_live_pa, g_live_base, g_live_len, g_slot, new, g_max_depth)
    tok1 = np.empty(max_spec_tokens, dtype=np.int32)
    par1 = np.empty(max_spec_tokens, dtype=np.int32)
    prob1 = np.empty(max_spec_tokens, dtype=np.float64)
    none = np.empty(0, dtype=np.int64)  # no sealed segments (text, sa and buckets are then never read)
    n1, s1, l1, _ = speculate_index(g_text, g_sa, none, none, none, none, g_buckets, r_live_tok, r_live_pa, r_live_base, r_live_len, context, r_max_depth,
                                    max_spec_tokens, alpha, min_prob, False, 0.0, 0, tok1, par1, prob1)
    n2 = 0
    s2 = 0.0
    l2 = 0
    tok2 = np.empty(max_spec_tokens, dtype=np.int32)
    prob2 = np.empty(max_spec_tokens, dtype=np.float64)
    if g_slot >= -1 and len(g_seg_lo) + len(g_live_len) > 0:
        n2, s2, l2, _ = speculate_index(g_text, g_sa, g_seg_lo, g_seg_hi, g_seg_bucket, g_seg_vocab, g_buckets,
                                        g_live_tok, g_live_pa, g_live_base, g_live_len, context, g_max_depth,
                                        max_spec_tokens, alpha, min_prob, False, 0.0, 0, tok2, par1, prob2)
    if n1 == 0:  # an empty path counts as no path (score 0, match 0): the other one is the answer
        out_tok[:n2] = tok2[:n2]
        out_prob[:n2] = prob2[:n2]
        return n2, s2 if n2 else 0.0, l2 if n2 else 0
    if n2 == 0:
        out_tok[:n1] = tok1[:n1]
        out_prob[:n1] = prob1[:n1]
        return n1, s1, l1
    match_len = max(l1, l2)
    # Both: they share a prefix (where the merged tree keeps the higher D) and then part.
    shared = 0
    while shared < min(n1, n2) and tok1[shared] == tok2[shared]:
        shared += 1
    head = 0.0
    for i in range(shared):
        head += max(prob1[i], prob2[i])
    tail1 = 0.0
    for i in range(shared, n1):
        tail1 += prob1[i]
    tail2 = 0.0
    for i in range(shared, n2):
        tail2 += prob2[i]
    mine = head + tail1
    theirs = head + tail2
    for i in range(shared):
        out_prob[i] = max(prob1[i], prob2[i])
    if theirs > mine:  # a tie keeps the request index's path
        tok1, prob1, n1, mine = tok2, prob2, n2, theirs
    out_prob[shared:n1] = prob1[shared:n1]
    out_tok[:n1] = tok1[:n1]
    return n1, mine, match_len


class StepArgs:
    """The kernel's arguments for one request, up to the per-step ones: valid while both indexes'
    kernel views (SuffixIndex.kernel_view) are the same objects and no one else appends to the
    request's live sequences."""

    __slots__ = ("request_view", "global_view", "args")

    def __init__(self, request: SuffixIndex, request_seq: int, glob: SuffixIndex | None, glob_seq: int,
                 room: int = 0) -> None:
        r_args, r_slot, r_cap = request.hot_args(request_seq, room)
        if len(r_args[2]):
            raise SuffixIndexError("a request index holds live sequences only")
        if glob is None:  # not drafted from (the kernel needs arrays of the same types)
            g_args, g_slot, g_cap, g_depth = r_args, -2, 0, 1
        elif glob_seq < 0:
            g_args, g_slot, g_cap, g_depth = glob.kernel_view(), -1, 0, glob.max_depth
        else:
            g_args, g_slot, g_cap = glob.hot_args(glob_seq, room)
            g_depth = glob.max_depth
        self.request_view = r_args
        self.global_view = g_args if glob is not None else None
        limit = (request.vocab_size - 1) if request.vocab_size is not None else MAX_TOKEN
        self.args = (*r_args[7:], r_slot, r_cap, request.max_depth, *g_args, g_slot, g_cap, g_depth, limit)


def draft_path(step: StepArgs | None, request: SuffixIndex, request_seq: int, glob: SuffixIndex | None,
               glob_seq: int, new: np.ndarray, context: np.ndarray, max_spec_tokens: int, max_spec_factor: float,
               min_token_prob: float, out: tuple[np.ndarray, np.ndarray]) -> tuple[Draft | None, StepArgs]:
    """`new` (checked tokens) appended to live sequence request_seq of `request` and glob_seq of
    `glob` (-1: not there; `glob` None: no global index), then the better path of the two indexes
    for `context` (int32). `step`: the StepArgs of the last call, reused while valid. `out`: int32 and float64
    buffers of at least max_spec_tokens (the caller's, reused). Returns the draft, None when a token
    of `context` is out of range (nothing was appended then), and the StepArgs to pass next.
    Drafting arguments are checked by the caller (SuffixCache.speculate; the two floats are floats)."""
    if (step is None or step.request_view is not request.kernel_view()
            or (glob is not None and step.global_view is not glob.kernel_view())):
        step = StepArgs(request, request_seq, glob, glob_seq)
    args = (new, context, max_spec_tokens, max_spec_factor, min_token_prob, *out)
    num, score, match_len = append_and_draft(*step.args, *args)
    if num == -2:  # a live region is full: it moves (a new view), then the call is made again
        step = StepArgs(request, request_seq, glob, glob_seq, len(new))
        num, score, match_len = append_and_draft(*step.args, *args)
    if num < 0:
        return None, step
    if len(new):
        request.appended(request_seq, len(new))
        if glob is not None and glob_seq >= 0:
            glob.appended(glob_seq, len(new))
    return Draft(out[0][:num].tolist(), list(range(-1, num - 1)), out[1][:num].tolist(), score, match_len), step
