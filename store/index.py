"""The persisted global suffix index of each tokenizer's stored outputs: brought up to date after
new calls (online adds, or a rebuild), loaded without re-sorting."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..core.index.suffix_index import SuffixIndex

from .db import IndexState, Store

MAX_DEPTH = 64
REBUILD_FRACTION = 0.1  # more new tokens than this share of the index: rebuild instead of adding


def update_index(store: Store, tokenizer_id: int, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Bring the persisted index of a tokenizer up to date: nothing, online adds, or a rebuild."""
    t0 = time.perf_counter()
    count, last = store.token_rows(tokenizer_id)
    state = store.index_state(tokenizer_id)
    if state is not None and (state.num_calls, state.last_token_rowid, state.max_depth) == (count, last, max_depth):
        return {"action": "unchanged", "calls": count, "tokens": state.num_tokens, "seconds": time.perf_counter() - t0}
    index = None
    action = "built"
    if state is not None and state.max_depth == max_depth \
            and store.token_rows(tokenizer_id, state.last_token_rowid)[0] == state.num_calls:
        # Only rows were added since: add them online unless they are many.
        new = [t for _, t in store.iter_tokens(tokenizer_id, after_rowid=state.last_token_rowid)]
        if sum(len(t) for t in new) <= REBUILD_FRACTION * max(state.num_tokens, 1):
            index = load_persisted(store, state)
            index.add_many(new)
            action = "updated"
    if index is None:
        index = SuffixIndex.build([t for _, t in store.iter_tokens(tokenizer_id)], max_depth=max_depth)
    store.save_index(IndexState(tokenizer_id, max_depth, count, last, index.num_tokens),
                     index.to_bytes(include_text=False))
    return {"action": action, "calls": count, "tokens": index.num_tokens, "seconds": time.perf_counter() - t0}


def load_persisted(store: Store, state: IndexState) -> SuffixIndex:
    """The saved index, its text reassembled from the token rows it covers (no re-sorting)."""
    parts = []
    for _, tokens in store.iter_tokens(state.tokenizer_id, upto_rowid=state.last_token_rowid):
        parts.append(tokens)
        parts.append(np.array([-1], dtype=np.int32))  # SEP after each sequence
    text = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return SuffixIndex.from_bytes(store.index_bytes(state.tokenizer_id), text=text)


def load_index(store: Store, tokenizer_id: int, max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """The global index of a tokenizer's stored outputs, brought up to date first if stale (in a
    store opened read-only, built in memory when stale: nothing can be saved there)."""
    if store.readonly:
        state = store.index_state(tokenizer_id)
        count, last = store.token_rows(tokenizer_id)
        if state is not None and (state.num_calls, state.last_token_rowid, state.max_depth) == (count, last, max_depth):
            return load_persisted(store, state)
        return SuffixIndex.build([t for _, t in store.iter_tokens(tokenizer_id)], max_depth=max_depth)
    update_index(store, tokenizer_id, max_depth)
    state = store.index_state(tokenizer_id)
    return load_persisted(store, state)  # type: ignore[arg-type]


def index_for(store: Store, fingerprint: str, max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """load_index for the tokenizer with this fingerprint; an empty index when the store has no
    tokens for it (what `specx generate` and `specx serve` draft from)."""
    tokenizer_id = store.tokenizer_id(fingerprint)
    return load_index(store, tokenizer_id, max_depth) if tokenizer_id is not None else SuffixIndex(max_depth)
