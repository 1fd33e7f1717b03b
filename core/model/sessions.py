"""Sessions over any model with `forward_batch`: what specx's own engines share (the quantized one,
core/model/quantized/engine.py, and the GPU one, core/model/gpu/engine.py), written once here.

    engine = QuantEngine("model.gguf")            # a SessionEngine: GPUEngine is another
    session = engine.start(prompt_ids[:-1], engine.new_prefix_cache(8192))
    logits = session.score([prompt_ids[-1]], draft)   # [1 + N, V], as every engine's
    session.keep_path(accepted_nodes)
    engine.score_batch(sessions, pendings, drafts)    # several sessions' passes in one
    engine.forward_batch([s.pass_for(p, d) for ...])   # the same, as a batched server runs it

What it asks of an engine's model: `config` (its `vocab`), `context_length`, and
`forward(kv, tokens, positions, allowed, logits_rows)` with `forward_batch([...])` (several such
parts in one pass, each row's logits the bits its own pass gives: batch-invariant kernels). Of a
cache (a KV cache of one sequence, the wing's own): `length`, `reused`, `capacity`, `reserve(n)`,
`keep(num_kept, moved)` and `copy(n, capacity)`. Each wing keeps what is its own: its model, its
KVCache and the prefix cache that makes them (`SessionPrefixCache.fresh`).

A pass is data (`Session.pass_for`: the model's forward_batch part), so core/serve/batch.py runs
several requests' passes as one, and a prompt's prefill as the passes it needs (`start_steps`,
PREFILL_CHUNK tokens each) beside them. Every pass goes through the engine's `forward_batch`, where
its thread count is chosen (`tune_threads`: core.model.threads).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from ..draft import Draft, check_draft
from .prefix_cache import PrefixCache
from .threads import ThreadTuner, retune, set_threads, timed

PREFILL_CHUNK = 64  # prompt tokens per pass: the quantized kernel's row chunk
# room a prefilled cache is made with past its prompt: an agent's answer and a draft tree's rows,
# so that a turn's cache is made once at its size, not grown (and copied) as it decodes
ANSWER_ROOM = 256


def prefill(model: Any, kv: Any, tokens: Sequence[int]) -> None:
    """Append `tokens` to `kv`, PREFILL_CHUNK at a time, each chunk causal."""
    for part in prefill_parts(kv, tokens):
        model.forward(*part)


def run_steps(steps: Generator[tuple[Any, ...], None, Any], run: Callable[[tuple[Any, ...]], Any]) -> Any:
    """Run each pass a steps generator (prefill_steps, start_steps) asks for with `run` (one
    model.forward, or a batched server's shared pass), before the next is asked for; what the
    generator returns."""
    try:
        part = next(steps)
        while True:
            run(part)
            part = next(steps)
    except StopIteration as done:
        return done.value


def prefill_parts(kv: Any, tokens: Sequence[int]) -> Iterator[tuple[Any, ...]]:
    """The passes that append `tokens` to `kv`, PREFILL_CHUNK at a time, each chunk causal, as
    forward_batch takes them: each is run before the next is made."""
    for start in range(0, len(tokens), PREFILL_CHUNK):
        chunk = list(tokens[start : start + PREFILL_CHUNK])
        n = len(chunk)
        positions = np.arange(kv.length, kv.length + n, dtype=np.int64)
        yield kv, chunk, positions, np.tril(np.ones((n, n), dtype=np.uint8)), np.array([n - 1])


def pass_size(parts: Sequence[tuple[Any, ...]]) -> tuple[int, int]:
    """(rows, context) of a pass over `parts` (forward_batch's): its rows, and the cache length
    they attend to, averaged over the rows (what a pass's cost is read at)."""
    rows = sum(len(part[1]) for part in parts)
    return rows, sum(part[0].length * len(part[1]) for part in parts) // max(rows, 1)


def tree_layout(num_cached: int, num_pending: int, draft: Draft) -> tuple[np.ndarray, np.ndarray]:
    """(positions [Q], allowed [Q, Q]) of a pass over the pending tokens then the draft's nodes:
    pending tokens causal, each node sees the pending tokens and its ancestors (core/model/transformers/tree.py)."""
    depths = np.asarray(draft.depths(), dtype=np.int64)
    positions = np.concatenate([np.arange(num_pending), num_pending - 1 + depths]).astype(np.int64) + num_cached
    q = num_pending + len(draft)
    allowed = np.zeros((q, q), dtype=np.uint8)
    allowed[:, :num_pending] = np.tril(np.ones((q, num_pending), dtype=np.uint8))
    for i, parent in enumerate(draft.parents):
        row = num_pending + i
        if parent >= 0:
            allowed[row, num_pending:] = allowed[num_pending + parent, num_pending:]
        allowed[row, row] = 1
    return positions, allowed


class SessionPrefixCache(PrefixCache, ABC):
    """PrefixCache for the sessions' engines; each wing's subclass makes its caches (`fresh`). A
    stored prompt is the session's own cache, not a copy: a session changes no entry of its prompt
    (it appends, and keep_path moves accepted rows only past the prompt), so the first len(prompt)
    entries stay what the prefill wrote while the session decodes on, and a conversation's KV is
    held once, not twice. A later prompt that starts the same way gets a copy of them (its own
    cache, made at its prompt's size + ANSWER_ROOM)."""

    def prefill(self, model: Any, tokens: Sequence[int], cache: Any = None) -> Any:
        return run_steps(self.prefill_steps(model, tokens), lambda part: model.forward(*part))

    @abstractmethod
    def fresh(self, model: Any, capacity: int = 256) -> Any:
        """An empty cache for `model`'s sequences, room for `capacity` entries."""

    def prefill_steps(self, model: Any, tokens: Sequence[int]) -> Generator[tuple[Any, ...], None, Any]:
        """`prefill` as the passes it needs (each run before the next is asked for; the batched
        server runs them beside other requests' passes); returns the cache."""
        started = time.perf_counter()
        tokens = [int(t) for t in tokens]
        usable = self.max_tokens > 0
        reuse, stored, turn = self._claim(tokens, usable)
        room = len(tokens) + ANSWER_ROOM
        kv = stored.copy(reuse, room) if stored is not None else self.fresh(model, room)
        kv.reused = reuse
        self.seconds += time.perf_counter() - started
        yield from prefill_parts(kv, tokens[reuse:])
        started = time.perf_counter()
        self._keep(tokens, reuse, usable, kv, turn)
        self.seconds += time.perf_counter() - started
        return kv


class Session:
    """One request's cache on a SessionEngine (`engine`): tree passes, the accepted path kept."""

    def __init__(self, engine: SessionEngine, kv: Any) -> None:
        self.engine, self.model, self.kv = engine, engine.model, kv
        self._kept = 0  # entries before the draft's in the last pass: the cache + the pending tokens

    def score(self, pending: list[int], draft: Draft) -> Any:
        return score_batch([self], [pending], [draft])[0]

    @property
    def reused(self) -> int:
        """The cache's entries copied from a prefix cache when the session began (the rest were prefilled)."""
        return self.kv.reused

    def pass_for(self, pending: list[int], draft: Draft) -> tuple[Any, ...]:
        """This pass as the model's forward_batch takes it (checked, bookkept): what a batcher runs
        beside other sessions' (core/serve/batch.py), then `keep_path` as after `score`."""
        check_draft(draft, self.model.config.vocab)
        if not pending:
            raise ValueError("verification needs at least one pending token (the root's logits come from it)")
        if self.kv.length + len(pending) + len(draft) > self.model.context_length:
            raise ValueError(f"the context of {self.model.context_length} tokens is full")
        self._kept = self.kv.length + len(pending)
        positions, allowed = tree_layout(self.kv.length, len(pending), draft)
        rows = np.arange(len(pending) - 1, len(pending) + len(draft))
        return self.kv, list(pending) + list(draft.token_ids), positions, allowed, rows

    def keep_path(self, accepted_nodes: list[int]) -> None:
        self.kv.keep(self._kept, [self._kept + n for n in accepted_nodes])


def score_batch(sessions: Sequence[Session], pendings: Sequence[list[int]], drafts: Sequence[Draft]) -> list[Any]:
    """Each session's `score` (logits [1 + N, V]) in one forward pass over all their rows: every
    weight read once for the batch, each session attending to its own cache; a session's logits
    are the bits its own pass gives (batch-invariant kernels). The sessions must be distinct and
    of one model; each then keeps its path with `keep_path` as after `score`."""
    import torch

    if len({id(s) for s in sessions}) != len(sessions) or len({id(s.engine) for s in sessions}) > 1:
        raise ValueError("a batch takes distinct sessions of one engine")
    parts = [s.pass_for(p, d) for s, p, d in zip(sessions, pendings, drafts)]
    return [torch.from_numpy(logits) for logits in sessions[0].engine.forward_batch(parts)]


class SessionEngine:
    """core.model.engine.Engine over a model with forward_batch (as the module says): the sessions,
    their prefix cache (`prefix_cache_type`, the wing's SessionPrefixCache), batched passes and
    plain decoding. A wing's engine makes its model, then calls this __init__, which runs one pass
    to compile (or load) every kernel a pass runs."""

    name: str
    prefix_cache_type: type[SessionPrefixCache]
    kv_bytes_per_token: int  # one position's keys and values over all layers, in the wing's caches
    batches = True
    prompt_lookup = False
    tree_unsupported = None
    tuner: ThreadTuner | None = None

    def __init__(self, model: Any) -> None:
        self.model = model
        self.path = model.path
        self.vocab_size = model.config.vocab
        self.context_length = model.context_length
        self.hit_tokens = 0
        started = time.perf_counter()
        prefill(model, self.new_prefix_cache(0).fresh(model, 16), [0])
        self.compile_seconds = time.perf_counter() - started

    def start(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None) -> Session:
        return run_steps(self.start_steps(tokens, prefix_cache), lambda part: self.forward_batch([part]))

    def forward_batch(self, parts: Sequence[tuple[Any, ...]]) -> list[Any]:
        """One pass over `parts` (Session.pass_for's, start_steps'): the model's forward_batch, on
        the thread count the tuner chooses (`tune_threads`); each part's logits rows."""
        with timed(self.tuner, *pass_size(parts)):
            return self.model.forward_batch(parts)

    def tune_threads(self, shape: Callable[[int, int], float] | None = None,
                     say: Callable[[str], None] | None = None) -> ThreadTuner | None:
        """core.model.engine.Engine.tune_threads: between numba's threads and one (its kernels' pool)."""
        import numba

        self.tuner = retune(self.tuner, numba.get_num_threads(), set_threads, shape, say)
        return self.tuner

    def start_steps(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None
                    ) -> Generator[tuple[Any, ...], None, Session]:
        """`start` as the prefill passes it needs (its prefix cache's prefill_steps); returns the session."""
        kind = self.prefix_cache_type
        prefixes = prefix_cache if isinstance(prefix_cache, kind) else kind(0)
        kv = yield from prefixes.prefill_steps(self.model, tokens)
        self.hit_tokens += kv.reused
        return Session(self, kv)

    score_batch = staticmethod(score_batch)

    def new_prefix_cache(self, max_tokens: int) -> SessionPrefixCache:
        return self.prefix_cache_type(max_tokens)

    def clear(self) -> None:
        """Nothing is held between requests (the prefix caches are the callers')."""

    def plain(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
              prefix_cache: PrefixCache | None = None, lookup: int | None = None) -> list[int]:
        """Greedy decoding one token per pass: the reference speculation on this engine equals."""
        if lookup:
            raise ValueError(f"prompt lookup runs on transformers; on the {self.name} engine: plain decoding "
                             "and specx")
        session = self.start(list(prompt[:-1]), prefix_cache)
        empty = Draft([], [], [], 0.0, 0)
        pending, out = [int(prompt[-1])], []
        while len(out) < max_new_tokens:
            tok = int(session.score(pending, empty)[0].argmax())
            session.keep_path([])
            out.append(tok)
            if tok == eos_token_id:
                break
            pending = [tok]
        return out
