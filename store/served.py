"""Requests answered by `specx serve`, stored like ingested agent logs.

Each answered request becomes one session of a "served" source (one source per served model,
path `served/<model>`), each of its choices one call: prompt messages (or prompt text), output
text, model, timings in started_at / ended_at / meta. Its token row holds the token ids the model
generated, exactly what the server's drafter learned, so a restarted server (load_index) rebuilds
the same global index. One transaction per request: a killed server leaves a request all in or
all out. `specx ls`, `entropy` and `replay --source served` read these calls like any other.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.index.successors import SuccessorTable

from .calls import ids_without_tokens, insert_calls, insert_tokens
from .db import Store, StoreError, content_key
from .formats import Call
from .index import update_index
from .successors import save_table
from .tenants import session_scope, source_key, token_rows

log = logging.getLogger("specx.served")
serve_log = logging.getLogger("specx.serve")  # `specx serve`'s log: ServedRecorder writes there

SERVED_FORMAT = "served"


class ServedRecorder:
    """`specx serve`'s "request finished" hook (core.serve.keeper.Recorder): each answered request
    stored as a served session (record_served, one transaction), the global index persisted when
    the worker asks (update_index: the persisted index plus every token row added since, whoever
    added it), so the next start loads it instead of rebuilding, and with it the drafter's successor
    table when it has one (store/successors.py). Opens its own connection on the worker's thread; a store failure is logged, never raised: the server keeps answering."""

    def __init__(self, path: Path, model_name: str, tokenizer_fingerprint: str, vocab_size: int,
                 speculation: bool, *, successors: SuccessorTable | None = None, successors_key: str | None = None) -> None:
        self.path, self.model_name, self.speculation = path, model_name, speculation
        self.fingerprint, self.vocab_size = tokenizer_fingerprint, vocab_size
        self.store: Store | None = None
        self.successors, self.successors_key = successors, successors_key  # kept with the index (store/successors.py)
        self._rows_kept = successors.rows_learned if successors is not None else 0
        self.last_rowids: list[int] = []  # the token rows the last recorded request wrote (core/serve/scopes.py)

    def open(self) -> None:
        self.store = Store(self.path)

    def record(self, req: Any, choices: list[Any], stats: Any, started_at: str, ended_at: str) -> bool:
        decoding = req.settings
        settings = {"endpoint": req.endpoint, "request_id": req.id, "prompt_tokens": stats.prompt_tokens,
                    "max_tokens": decoding.max_new_tokens, "temperature": decoding.temperature,
                    "top_p": decoding.top_p, "top_k": decoding.top_k, "seed": decoding.seed,
                    "stop": list(decoding.stop), "speculation": self.speculation,
                    "seconds": round(stats.seconds, 4), "queue_seconds": round(stats.queue_seconds, 4)}
        calls = [Call(session_id=req.id, position=c.index, output_text=c.text, prompt_messages=req.prompt_messages,
                      prompt_text=req.prompt_text, model=req.model, started_at=started_at, ended_at=ended_at,
                      meta={**settings, "finish_reason": c.finish_reason, "completion_tokens": len(c.token_ids),
                            "steps": c.stats.steps, "accepted": c.stats.accepted, "drafted": c.stats.drafted})
                 for c in choices]
        self.last_rowids = []
        try:
            self.last_rowids = record_served(self.store, self.model_name, calls, [c.token_ids for c in choices],
                                             self.fingerprint, self.model_name, self.vocab_size,
                                             tenant=getattr(req, "tenant", ""))
        except (sqlite3.Error, StoreError, OSError, ValueError) as exc:  # ValueError: UnicodeError (a lone surrogate)
            serve_log.error("%s: could not store the request: %s: %s", req.id, type(exc).__name__, exc)
            return False
        return True

    def persist(self) -> bool:
        try:
            tokenizer_id = self.store.tokenizer_id(self.fingerprint)
            if tokenizer_id is not None:
                result = update_index(self.store, tokenizer_id)
                serve_log.info("index persisted: %s, %d outputs, %d tokens (%.2f s)", result["action"], result["calls"],
                         result["tokens"], result["seconds"])
            table = self.successors
            if table is not None and self.successors_key is not None and table.rows_learned != self._rows_kept:
                save_table(self.store, self.successors_key, table)
                self._rows_kept = table.rows_learned
                serve_log.info("successor table kept: %d tokens with successors", len(table))
            return True
        except (sqlite3.Error, StoreError, OSError) as exc:
            serve_log.error("could not persist the index: %s", exc)
            return False

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def record_served(store: Store, model: str, calls: list[Call], token_ids: Sequence[Sequence[int]],
                  tokenizer_fingerprint: str, tokenizer_name: str, vocab_size: int, tenant: str = "") -> list[int]:
    """Store one served request's calls (one per choice) and their output tokens in `tenant`'s
    history; returns the rowids of the token rows written.

    `token_ids[i]` are the tokens generated for `calls[i]`.
    """
    if len(calls) != len(token_ids):
        raise ValueError(f"{len(calls)} calls but {len(token_ids)} token lists")
    path = Path("served") / model
    with store.db.atomic():
        tokenizer_id = store.add_tokenizer(tokenizer_fingerprint, tokenizer_name, vocab_size)
        key = source_key(SERVED_FORMAT, model, tenant)
        store.db.execute(
            "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error,"
            " tenant) VALUES (?, ?, ?, '', 0, datetime('now'), ?, 0, NULL, ?) ON CONFLICT(key) DO UPDATE SET"
            " num_calls = sources.num_calls + excluded.num_calls, ingested_at = excluded.ingested_at",
            [key, path.as_posix(), SERVED_FORMAT, len(calls), tenant])
        source_id = store.db.execute("SELECT id FROM sources WHERE key = ?", [key]).fetchone()[0]
        call_ids, _ = insert_calls(store, source_id, path, SERVED_FORMAT, calls,
                                   scope=session_scope(path.name, tenant))
        missing = set(ids_without_tokens(store, call_ids, tokenizer_id))
        rows = []
        for cid, tokens in zip(call_ids, token_ids):
            if cid in missing:
                missing.discard(cid)  # the same call twice in one request: one token row
                rows.append((cid, tokens))
        insert_tokens(store, tokenizer_id, rows)
        rowids = [r[0] for r in store.db.execute(
            f"SELECT rowid FROM tokens WHERE tokenizer_id = ? AND call_id IN ({','.join('?' * len(rows))})",
            [tokenizer_id, *(cid for cid, _ in rows)])] if rows else []
    return rowids


def token_rows_since(store: Store, tokenizer_id: int, after_rowid: int, upto_rowid: int,
                     skip_sessions: str | None = None) -> list[tuple[int, np.ndarray]]:
    """(rowid, tokens) of the token rows in (after_rowid, upto_rowid], oldest first, leaving out served
    sessions whose key starts with `skip_sessions` (this process's own): what other writers (another
    replica, an ingest) added since this process last looked."""
    def own(fmt: str, session: str) -> bool:
        return bool(skip_sessions) and fmt == SERVED_FORMAT and session.startswith(skip_sessions)

    return [(r.rowid, r.tokens) for r in token_rows(store, tokenizer_id, after_rowid, skip=own, upto_rowid=upto_rowid)]


@dataclass
class ServedRequest:
    """A finished request as an engine saw it: token ids only (the writer decodes them)."""

    request_id: str
    prompt: np.ndarray
    output: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


class ServedWriter:
    """Stores finished requests from a thread of its own, off the decode path (an engine's drafter
    hands them over with `put`, which never blocks). Each request is one served session, stored in
    one transaction by `record_served`. Every `sync_s` seconds it also reads the token rows other
    writers added (another replica on the same store, an ingest) and passes them to `on_rows`;
    `close` stores what is queued and persists the global index, so the next start loads it; so
    does a quiet spell of `persist_idle_s` after new requests (engines may be killed at shutdown).

    `session_prefix` starts every session key this writer stores (one per process and start), which
    keeps request ids that engines reuse across restarts apart and tells its own rows from others'.
    """

    def __init__(self, path: Path, model: str, tokenizer_fingerprint: str, tokenizer_name: str, vocab_size: int,
                 decode: Callable[[np.ndarray], str], session_prefix: str, after_rowid: int = 0,
                 on_rows: Callable[[list[np.ndarray]], None] | None = None, sync_s: float = 10.0,
                 max_depth: int = 64, persist_idle_s: float = 10.0) -> None:
        self.path = Path(path)
        self.model = model
        self.fingerprint = tokenizer_fingerprint
        self.tokenizer_name = tokenizer_name
        self.vocab_size = vocab_size
        self.decode = decode
        self.session_prefix = session_prefix
        self.after_rowid = after_rowid
        self.on_rows = on_rows
        self.sync_s = sync_s
        self.max_depth = max_depth
        self.persist_idle_s = persist_idle_s
        self.num_stored = 0
        self._unsaved = 0  # requests stored since the index was last persisted
        self.num_failed = 0
        self._queue: queue.Queue[ServedRequest | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="specx-served-writer", daemon=True)
        self._thread.start()

    def put(self, request: ServedRequest) -> None:
        if not self._closed:
            self._queue.put(request)

    def close(self, timeout: float = 60.0) -> None:
        """Store everything queued, persist the index, stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        store = self._open()  # sqlite connections belong to the thread that opens them
        if store is None:
            while self._queue.get() is not None:  # nothing can be stored: count what is dropped
                self.num_failed += 1
            return
        synced_at = stored_at = time.monotonic()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=1.0)
                except queue.Empty:
                    if self._unsaved and time.monotonic() - stored_at >= self.persist_idle_s:
                        self._persist(store)
                else:
                    if item is None:
                        break
                    self._store(store, item)
                    stored_at = time.monotonic()
                if self.sync_s and time.monotonic() - synced_at >= self.sync_s:
                    synced_at = time.monotonic()
                    self._sync(store)
            self._persist(store)
        finally:
            store.close()

    def _open(self, tries: int = 5) -> Store | None:
        # Another process opening a new store at the same moment can make SQLite answer "database
        # is locked" at once (two upgrading transactions): wait and try again.
        for attempt in range(tries):
            try:
                return Store(self.path)
            except StoreError as exc:
                if attempt == tries - 1:
                    log.error("specx: cannot store served requests: %s", exc)
                    return None
                time.sleep(0.5 * (attempt + 1))
        return None

    def _store(self, store: Store, req: ServedRequest) -> None:
        session = f"{self.session_prefix}{req.request_id}"
        try:
            call = Call(session_id=session, position=0, output_text=self.decode(req.output),
                        prompt_text=self.decode(req.prompt), model=self.model,
                        meta={"request_id": req.request_id, "prompt_tokens": len(req.prompt),
                              "completion_tokens": len(req.output), **req.meta})
            record_served(store, self.model, [call], [req.output.tolist()], self.fingerprint, self.tokenizer_name,
                          self.vocab_size)
            self.num_stored += 1
            self._unsaved += 1
        except (sqlite3.Error, StoreError, OSError, UnicodeError) as exc:
            self.num_failed += 1
            log.error("specx: could not store request %s: %s", req.request_id, exc)

    def _sync(self, store: Store) -> None:
        try:
            tokenizer_id = store.tokenizer_id(self.fingerprint)
            if tokenizer_id is None:
                return
            last = store.token_rows(tokenizer_id)[1]
            rows = token_rows_since(store, tokenizer_id, self.after_rowid, last, self.session_prefix)
            self.after_rowid = max(self.after_rowid, last)
            if rows and self.on_rows is not None:
                self.on_rows([tokens for _, tokens in rows])
        except (sqlite3.Error, StoreError, OSError) as exc:
            log.error("specx: could not read new rows from %s: %s", self.path, exc)

    def _persist(self, store: Store) -> None:
        try:
            tokenizer_id = store.tokenizer_id(self.fingerprint)
            if tokenizer_id is not None and self._unsaved:
                result = update_index(store, tokenizer_id, self.max_depth)
                self._unsaved = 0
                log.info("specx: index persisted (%s, %d outputs, %d tokens, %.2f s)", result["action"],
                         result["calls"], result["tokens"], result["seconds"])
        except (sqlite3.Error, StoreError, OSError) as exc:
            log.error("specx: could not persist the index: %s", exc)
