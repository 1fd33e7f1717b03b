"""A live store: `specx serve` follows what is ingested, merged or added to its store while it runs.

A thread of its own checks SQLite's data_version (it changes when another connection commits)
every `interval` seconds; when it moved, it reads the token rows added since it last looked and
hands them to the server's scopes (core/serve/scopes.py), which add them between decoding steps.
Rows that went away (a corpus removed, over HTTP or by another process) and backlogs too large to
add between steps rebuild the indexes of the scopes they draft in (with tenants: their tenant's,
every scope for public rows), here, off the decoding thread; the rebuilt index is swapped in
between steps. Nothing here writes to the store.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..core.index.suffix_index import SuffixIndex

from .db import Store, StoreError
from .index import MAX_DEPTH
from .tenants import Row, data_version, tenant_row_counts, token_rows

log = logging.getLogger("specx.serve")

REBUILD_TOKENS = 262_144  # a backlog past this (and past a tenth of the index) is rebuilt, not added


def scope_index(tenants: list[str] | None, rows: list[Row], max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """A scope's index built from the store's `rows`: those of `tenants` (None: all)."""
    return SuffixIndex.build([r.tokens for r in rows if tenants is None or r.tenant in tenants], max_depth)


def load_scopes(store: Store, fingerprint: str, tenants: list[str], max_depth: int = MAX_DEPTH) -> tuple[Any, int, int]:
    """The scopes of a server with `tenants` (each its own rows and the public ones), built from the
    store, and (count, last rowid) of the token rows they hold, for the watcher to go on from."""
    from ..core.serve.scopes import Scopes, drafts_from

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
        self._counts: dict[str, int] | None = None  # each tenant's rows up to `last` (read at the first look)
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
        if self._counts is None and self.scopes.tenants:  # (one scope without tenants: no need to know whose)
            self._counts = tenant_row_counts(store, tokenizer_id, self.last)
            if sum(self._counts.values()) != self.count:  # rows went away before the first look: whose is unknown
                self._rebuild.update(self.scopes.names)
        count, last = store.token_rows(tokenizer_id)
        new = token_rows(store, tokenizer_id, after_rowid=self.last, upto_rowid=last)
        rebuild, waiting = set(self._rebuild), list(self._rebuilt)
        self._rebuild.clear()
        del self._rebuilt[: len(waiting)]
        if count != self.count + len(new):  # rows went away: the scopes they drafted in are rebuilt
            if self._counts is None:
                rebuild.update(self.scopes.names)
            else:
                expected = dict(self._counts)
                for r in new:
                    expected[r.tenant] = expected.get(r.tenant, 0) + 1
                self._counts = tenant_row_counts(store, tokenizer_id, last)
                rebuild.update(s for t in set(self._counts) | set(expected)
                               if self._counts.get(t, 0) != expected.get(t, 0) for s in self.scopes.scopes_of(t))
            log.info("store watch: %d stored outputs were removed; rebuilding the indexes of %s",
                     self.count + len(new) - count, ", ".join(repr(s) for s in sorted(rebuild)) or "no scope")
        elif self._counts is not None:
            for r in new:
                self._counts[r.tenant] = self._counts.get(r.tenant, 0) + 1
        backlog = sum(len(r.tokens) for r in new)
        if backlog > REBUILD_TOKENS and backlog > 0.1 * self.scopes.num_tokens:
            rebuild.update(s for r in new for s in self.scopes.scopes_of(r.tenant))
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
