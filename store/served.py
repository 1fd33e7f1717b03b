"""Requests answered by `specx serve`, stored like ingested agent logs.

Each answered request becomes one session of a "served" source (one source per served model,
path `served/<model>`), each of its choices one call: prompt messages (or prompt text), output
text, model, timings in started_at / ended_at / meta. Its token row holds the token ids the model
generated, exactly what the server's drafter learned, so a restarted server (load_index) rebuilds
the same global index. One transaction per request: a killed server leaves a request all in or
all out. `specx ls`, `entropy` and `replay --source served` read these calls like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .db import Store, content_key
from .formats import Call
from .ingest import _ids_without_tokens, _insert_calls, insert_tokens

SERVED_FORMAT = "served"


def record_served(store: Store, model: str, calls: list[Call], token_ids: Sequence[Sequence[int]],
                  tokenizer_fingerprint: str, tokenizer_name: str, vocab_size: int) -> int:
    """Store one served request's calls (one per choice) and their output tokens; returns the tokenizer id.

    `token_ids[i]` are the tokens generated for `calls[i]`.
    """
    if len(calls) != len(token_ids):
        raise ValueError(f"{len(calls)} calls but {len(token_ids)} token lists")
    path = Path("served") / model
    with store.db.atomic():
        tokenizer_id = store.add_tokenizer(tokenizer_fingerprint, tokenizer_name, vocab_size)
        key = content_key(SERVED_FORMAT, model)
        store.db.execute(
            "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error)"
            " VALUES (?, ?, ?, '', 0, datetime('now'), ?, 0, NULL) ON CONFLICT(key) DO UPDATE SET"
            " num_calls = sources.num_calls + excluded.num_calls, ingested_at = excluded.ingested_at",
            [key, path.as_posix(), SERVED_FORMAT, len(calls)])
        source_id = store.db.execute("SELECT id FROM sources WHERE key = ?", [key]).fetchone()[0]
        call_ids, _ = _insert_calls(store, source_id, path, SERVED_FORMAT, calls)
        missing = set(_ids_without_tokens(store, call_ids, tokenizer_id))
        rows = []
        for cid, tokens in zip(call_ids, token_ids):
            if cid in missing:
                missing.discard(cid)  # the same call twice in one request: one token row
                rows.append((cid, tokens))
        insert_tokens(store, tokenizer_id, rows)
    return tokenizer_id
