"""Many concurrent requests drafting from one global index: what a serving engine drives.

`SuffixCache` has the interface of ArcticInference's `SuffixDecodingCache`, the object vLLM's
`suffix` speculative method calls once per request per step (start_request, add_active_response,
speculate, stop_request, evict_cached_response, active_requests, cached_requests), with specx's
indexes behind it: each request drafts from its own request index (prompt + output so far) and
from the global index, which holds earlier outputs and, live, every output being generated.

Engines stop requests lazily and do not say why: vLLM calls stop_request when a request is missing
from the batch, which happens when it finished, but also when it was preempted or simply not
scheduled in that step, and then it comes back with the same id (evict_cached_response, then
start_request). So a stopped request stays *pending*: its output remains a live sequence of the
global index, and a start with the same id and prompt resumes it, output and all. It is *finished*
(sealed into the global index and handed to `on_finish(request_id, prompt, output)` exactly once;
specx's vLLM plugin stores it) when the engine says so (`engine_step`: the plugin passes on the
scheduler's finished request ids at each step), or else `linger_s` after its stop. A linger alone cuts an
output into pieces whenever a request waits longer than that between two of its steps (on a CPU,
behind other requests' long prefills, it did at 2 s). An idle engine makes no calls, so its last
requests are never stopped: `finish_idle` (called from a timer) finishes them, but not while a step
is under way (told by `engine_step`; on a CPU one step of long prefills took over 10 s, and
finishing its requests as idle cut them into pieces too), and `flush()` finishes everything,
active requests included (at shutdown).

Engines verify linear drafts only (vLLM v1): `speculate` grows a path from each index, merges
them as SuffixDrafter does, and returns the one with the highest expected accepted length
(`use_tree_spec` grows and returns trees). The tokens add_active_response gets are appended by the
next speculate, in the same compiled call that drafts (core.index.engine_step): an engine's budget per
request per step is tens of microseconds, and separate calls spent more on glue than on drafting.

>>> cache = SuffixCache(SuffixIndex.build([[5, 6, 7, 8]]))
>>> cache.start_request("a", [1, 5, 6])
>>> cache.add_active_response("a", [7])
>>> cache.speculate("a", [1, 5, 6, 7], max_spec_tokens=4).token_ids
[8]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, KeysView, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..draft import Draft
from .engine_step import StepArgs, draft_path
from .suffix_array import SORT_DEPTH, first_out_of_range
from .suffix_index import SuffixIndex, check_speculate_args
from .tokens import MAX_TOKEN, SuffixIndexError, check_tokens

OnFinish = Callable[[Hashable, np.ndarray, np.ndarray], None]
_NONE = np.zeros(0, dtype=np.int64)
_INT32 = np.dtype(np.int32)


@dataclass
class _Request:
    prompt: np.ndarray
    index: SuffixIndex  # the request index: prompt + output so far, one live sequence
    seq_id: int  # that sequence's id
    live_id: int  # the output's live sequence in the global index (-1: no global index)
    stopped_at: float | None = None  # monotonic time of the last stop; None while active
    seen_at: float = 0.0  # monotonic time of the last call about it
    pending: np.ndarray = field(default_factory=lambda: _NONE)  # checked int64 tokens not yet in the indexes
    step: StepArgs | None = None  # the drafting kernel's arguments, reused across steps

    @property
    def output(self) -> np.ndarray:
        return self.index.live_tokens(self.seq_id)[len(self.prompt) :]

    def settle(self, global_index: SuffixIndex) -> None:
        """Pending tokens into both indexes (the path speculate takes fuses this with drafting)."""
        if len(self.pending):  # checked by add_active_response
            self.index.append(self.seq_id, self.pending, checked=True)
            if self.live_id >= 0:
                global_index.append(self.live_id, self.pending, checked=True)
            self.pending = _NONE
            self.step = None


class SuffixCache:
    """SuffixDecodingCache's interface over a specx global index; see the module docstring.

    `max_cached_requests` = 0 turns the global index off (no learning, drafts from the prompt
    only), as in ArcticInference; any other value is accepted and the global index is bounded by
    its own byte budget instead (`SuffixIndex(budget_bytes=...)`), not by a request count.
    """

    def __init__(self, global_index: SuffixIndex | None = None, *, max_tree_depth: int = 64,
                 max_cached_requests: int = -1, on_finish: OnFinish | None = None, linger_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.global_index = global_index if global_index is not None else SuffixIndex(64)
        if not 1 <= max_tree_depth:
            raise SuffixIndexError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
        self.max_tree_depth = min(max_tree_depth, self.global_index.max_depth)
        self.max_cached_requests = max_cached_requests
        self.use_global = max_cached_requests != 0
        self.on_finish = on_finish
        self.linger_s = linger_s
        self.clock = clock
        self._active: dict[Hashable, _Request] = {}
        self._pending: dict[Hashable, _Request] = {}  # stopped, may resume
        self._evicted: dict[Hashable, _Request] = {}  # evicted while pending: resumed by the next start
        vocab = self.global_index.vocab_size
        self._token_limit = MAX_TOKEN if vocab is None else vocab - 1
        self._step_at = -np.inf  # when the engine last said it began a step (engine_step)
        self._checked: tuple = ()  # the last drafting arguments that passed check_speculate_args
        self._out = (np.empty(SORT_DEPTH, dtype=np.int32), np.empty(SORT_DEPTH, dtype=np.float64))  # path buffers

    # ------------------------------------------------------------ the engine's calls

    @property
    def active_requests(self) -> KeysView:
        return self._active.keys()

    @property
    def cached_requests(self) -> KeysView:
        """Stopped requests whose output is still pending (a start with the same id resumes it)."""
        return self._pending.keys()

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        """Begin (or resume) a request: its prompt becomes its request index."""
        if req_id in self._active:
            raise SuffixIndexError(f"request {req_id!r} is already active")
        prompt = check_tokens(prompt_token_ids, self.global_index.vocab_size, "prompt").copy()
        old = self._evicted.pop(req_id, None) or self._pending.pop(req_id, None)
        self._finish_lingering()
        if old is not None and np.array_equal(old.prompt, prompt):
            old.stopped_at = None  # the same request back in the batch: its output so far goes on
            old.seen_at = self.clock()
            self._active[req_id] = old
            return
        if old is not None:
            self._finish(req_id, old)
        index = SuffixIndex(self.global_index.max_depth, self.global_index.vocab_size)
        seq_id = index.start(prompt)
        live_id = self.global_index.start() if self.use_global else -1
        self._active[req_id] = _Request(prompt, index, seq_id, live_id, seen_at=self.clock())

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int] | np.ndarray) -> None:
        """Tokens the model produced for the request (accepted + bonus). Both indexes take them with the
        next call about the request: the next speculate appends and drafts in one compiled call."""
        req = self._get_active(req_id)
        req.seen_at = self.clock()
        tokens = np.asarray(token_ids)  # an engine's list of ints: int64, checked in one compiled pass
        if (tokens.dtype != np.int64 or tokens.ndim != 1 or tokens is token_ids
                or first_out_of_range(tokens, self._token_limit) >= 0):
            tokens = check_tokens(tokens, self.global_index.vocab_size).astype(np.int64)  # or a clear error
        req.pending = np.concatenate((req.pending, tokens)) if len(req.pending) else tokens

    def stop_request(self, req_id: Hashable) -> None:
        """The request left the batch: finished, preempted or not scheduled; it lingers (see module doc)."""
        req = self._get_active(req_id)
        del self._active[req_id]
        req.settle(self.global_index)
        req.stopped_at = self.clock()
        self._pending[req_id] = req
        self._finish_lingering()

    def engine_step(self, finished: Iterable[Hashable] | Mapping[Hashable, Sequence[int]] = ()) -> int:
        """The engine begins a step (so it is not idle, however long the step takes), and says which
        requests are over (finished or aborted), stopped yet or not: each known one is finished now.
        `finished` may map each id to the request's whole output as the engine has it: the tokens the
        cache never got are appended first. (vLLM skips its drafter in every step where a request of
        the batch is within `num_speculative_tokens` of the context limit, so the tokens of those
        steps never reach the cache.) Returns how many were finished."""
        self._step_at = self.clock()
        outputs = finished if isinstance(finished, Mapping) else {}
        done = 0
        for req_id in finished:
            req = self._active.pop(req_id, None) or self._pending.pop(req_id, None) or self._evicted.pop(req_id, None)
            if req is None:
                continue
            full = outputs.get(req_id)
            whole = None
            if full is not None:
                req.settle(self.global_index)
                have, full = req.output, check_tokens(np.asarray(full), self.global_index.vocab_size)
                if len(full) > len(have) and np.array_equal(full[: len(have)], have):
                    req.pending = full[len(have):].astype(np.int64)  # the last steps' tokens
                elif not np.array_equal(full, have):
                    whole = full  # tokens missing in the middle (a request skipped while another was near the limit)
            self._finish(req_id, req, whole)
            done += 1
        return done

    def evict_cached_response(self, req_id: Hashable) -> None:
        """vLLM calls this just before restarting a stopped request: the next start resumes it."""
        req = self._pending.pop(req_id, None)
        if req is None:
            raise SuffixIndexError(f"request {req_id!r} has no cached response")
        self._evicted[req_id] = req

    def speculate(self, req_id: Hashable, context: Sequence[int] | np.ndarray, max_spec_tokens: int | None = None,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  use_tree_spec: bool = False) -> Draft:
        """Draft for the request after `context` (its last tokens): the best path, or the tree.

        `max_spec_offset` is accepted for interface compatibility; specx sizes by max_spec_factor.
        """
        req = self._get_active(req_id)
        limit = self.max_tree_depth if max_spec_tokens is None else int(max_spec_tokens)
        limit = min(limit, SORT_DEPTH - self.global_index.max_depth)
        ctx = context[-self.max_tree_depth:] if type(context) is np.ndarray and context.dtype is _INT32 \
            and context.ndim == 1 else check_tokens(np.asarray(context)[-self.max_tree_depth:], None, "context")
        if limit <= 0 or len(ctx) == 0:
            req.settle(self.global_index)
            return Draft()
        args = (limit, float(max_spec_factor), float(min_token_prob), bool(use_tree_spec))
        if args != self._checked:
            check_speculate_args(None, *args[:3], self.global_index.max_depth)
            self._checked = args
        if not use_tree_spec:  # the engine's hot path: appends and both paths in one compiled call
            draft, req.step = draft_path(req.step, req.index, req.seq_id, self.global_index if self.use_global else None,
                                         req.live_id, req.pending, ctx, *args[:3], self._out)
            if draft is None:  # a context token out of range: nothing was appended; say which
                check_tokens(ctx, self.global_index.vocab_size, "context")
            req.pending = _NONE
            return draft
        req.settle(self.global_index)
        ctx = check_tokens(ctx, self.global_index.vocab_size, "context")
        mine = req.index.speculate(ctx, *args, checked=True) or Draft()
        other = (self.global_index.speculate(ctx, *args, checked=True) or Draft()) if self.use_global else Draft()
        return mine.union(other, limit)  # the union of the trees, as SuffixDrafter

    # ------------------------------------------------------------ lifetime

    def flush(self) -> int:
        """Finish every request, active ones included (at shutdown); returns how many were finished."""
        todo = list(self._active.items()) + list(self._pending.items()) + list(self._evicted.items())
        self._active.clear()
        self._pending.clear()
        self._evicted.clear()
        for req_id, req in todo:
            self._finish(req_id, req)
        return len(todo)

    def finish_idle(self, idle_s: float) -> int:
        """Finish lingering requests, and active ones without a new token for `idle_s` and no engine
        step begun since (an engine stops a request only at its next step, and an idle engine takes
        none; a step that takes longer than `idle_s` is not idleness). A request that comes back
        after this starts again. Returns how many were finished."""
        now = self.clock()
        idle = [r for r, req in self._active.items() if now - req.seen_at >= idle_s and req.seen_at >= self._step_at]
        for req_id in idle:
            self._finish(req_id, self._active.pop(req_id))
        return len(idle) + self._finish_lingering()

    def _finish_lingering(self) -> int:
        now = self.clock()
        done = [r for r, req in self._pending.items() if now - req.stopped_at >= self.linger_s]
        for req_id in done:
            self._finish(req_id, self._pending.pop(req_id))
        gone = list(self._evicted)  # evicted and not restarted by the engine
        for req_id in gone:
            self._finish(req_id, self._evicted.pop(req_id))
        return len(done) + len(gone)

    def _finish(self, req_id: Hashable, req: _Request, whole: np.ndarray | None = None) -> None:
        """Seal the request's output in the global index and hand it on; `whole` (the engine's own
        copy) replaces an output that lacks tokens."""
        req.settle(self.global_index)
        output = req.output.copy() if whole is None else whole.copy()
        if req.live_id >= 0:  # the global index has the output already, live: seal it
            if len(output) and whole is None:
                self.global_index.finish(req.live_id)
            else:
                self.global_index.discard(req.live_id)
                if len(output):
                    self.global_index.add(output)
        if self.on_finish is not None and len(output):
            self.on_finish(req_id, req.prompt, output)

    def _get_active(self, req_id: Hashable) -> _Request:
        req = self._active.get(req_id)
        if req is None:
            raise SuffixIndexError(f"request {req_id!r} is not active")
        return req
