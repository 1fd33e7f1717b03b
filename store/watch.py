"""A live store: `specx serve` follows what is ingested, merged or added to its store while it runs.

A thread of its own checks SQLite's data_version (it changes when another connection commits)
every `interval` seconds; when it moved, it reads the token rows added since it last looked and
hands them to the server's scopes (core/serve/scopes.py), which add them between decoding steps.
Rows that went away (a corpus removed, over HTTP or by another process) and backlogs too large to
add between steps rebuild the scopes' indexes here, off the decoding thread; the rebuilt index is
swapped in between steps. Nothing here writes to the store.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from specx.core.index.suffix_index import SuffixIndex

from .db import Store, StoreError
from .index import MAX_DEPTH
from .tenants import Row, data_version, token_rows

log = logging.getLogger("specx.serve")

REBUILD_TOKENS = 262_144  # a backlog past this (and past a tenth of the index) is rebuilt, not added


def scope_index(tenants: list[str] | None, rows: list[Row], max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """A scope's index built from the store's `rows`: those of `tenants` (None: all)."""
    return SuffixIndex.build([r.tokens for r in rows if tenants is None or r.tenant in tenants], max_depth)


def load_scopes(store: Store, fingerprint: str, tenants: list[str], max_depth: int = MAX_DEPTH) -> tuple[Any, int, int]:
    """The scopes of a server with `tenants` (each its own rows and the public ones), built from the
    store, and (count, last rowid) of the token rows they hold, for the watcher to go on from."""
    from specx.core.serve.scopes import Scopes, drafts_from

    tokenizer_id = store.tokenizer_id(fingerprint)
    count, last = store.token_rows(tokenizer_id) if tokenizer_id is not None else (0, 0)
    rows = token_rows(store, tokenizer_id, upto_rowid=last) if tokenizer_id is not None else []
    indexes = {t: scope_index(drafts_from(t, True), rows, max_depth) for t in tenants}
    return Scopes(indexes, tenants=True), count, last


class StoreWatcher:
    """Follows the store at `path` for the tokenizer `fingerprint`, feeding `scopes`; starts from
    `count` token rows up to rowid `last` (what the scopes hold)."""

    def __init__(self, path: Path, fingerprint: str, scopes: Any, *, count: int, last: int, interval: float = 0.5,
                 max_depth: int = MAX_DEPTH) -> None:
        self.path, self.fingerprint, self.scopes = Path(path), fingerprint, scopes
        self.count, self.last, self.interval, self.max_depth = count, last, interval, max_depth
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._rebuild: set[str] = set()
        self._rebuilt: list[threading.Event] = []  # set once the asked rebuilds are handed to the scopes
        self.version: int | None = None
        self.seen_at: float | None = None  # when rows were last handed over (monotonic)
        self._thread = threading.Thread(target=self._run, name="specx-store-watch", daemon=True)

    def start(self) -> "StoreWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(10)

    def rebuild(self, scopes: list[str] | None = None) -> threading.Event:
        """Rebuild these scopes (None: all) at once, e.g. after a corpus was removed; the event is set
        when the rebuilt indexes are handed over (they draft from the next step on)."""
        done = threading.Event()
        self._rebuilt.append(done)
        self._rebuild.update(scopes if scopes is not None else self.scopes.names)
        self._wake.set()
        return done

    def poke(self) -> None:
        """Look now (this server just wrote to the store)."""
        self._wake.set()

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if store is None:
                    store = Store(self.path, readonly=True)
                self.poll(store)
            except (StoreError, OSError, Exception) as exc:  # noqa: BLE001 - the server goes on; tried again
                log.error("store watch: %s: %s", type(exc).__name__, exc)
                if store is not None:
                    store.close()
                store = None
                time.sleep(self.interval)
        if store is not None:
            store.close()

    def poll(self, store: Store) -> None:
        """One look: hand over new rows, rebuild where rows went away or the backlog is large."""
        version = data_version(store.db.conn)
        if version == self.version and not self._rebuild:
            return
        self.version = version
        tokenizer_id = store.tokenizer_id(self.fingerprint)
        if tokenizer_id is None:  # nothing stored for this tokenizer yet: nothing to rebuild either
            self._rebuild.clear()
            while self._rebuilt:
                self._rebuilt.pop().set()
            return
        count, last = store.token_rows(tokenizer_id)
        new = token_rows(store, tokenizer_id, after_rowid=self.last, upto_rowid=last)
        rebuild, waiting = set(self._rebuild), list(self._rebuilt)
        self._rebuild.clear()
        del self._rebuilt[: len(waiting)]
        if count != self.count + len(new):  # rows went away: every scope is rebuilt from what is left
            rebuild = set(self.scopes.names)
            log.info("store watch: %d stored outputs were removed; rebuilding the indexes",
                     self.count + len(new) - count)
        backlog = sum(len(r.tokens) for r in new)
        if backlog > REBUILD_TOKENS and backlog > 0.1 * self.scopes.num_tokens:
            rebuild = set(self.scopes.names)
        if rebuild:
            rows = token_rows(store, tokenizer_id, upto_rowid=last)
            for scope in sorted(rebuild):
                self.scopes.replace(scope, scope_index(self.scopes.tenants_of(scope), rows, self.max_depth), last)
        if new:
            self.scopes.offer((r.rowid, r.tenant, r.tokens) for r in new)
            log.info("store watch: %d new outputs (%d tokens) in the store", len(new), backlog)
        self.count, self.last = count, last
        self.seen_at = time.monotonic()
        for done in waiting:
            done.set()
