"""What the worker keeps of the requests it answers, beyond the global index in memory.

A finished request has already entered the global index (its scope's, core/serve/scopes.py: the
drafter's finish_request); the Keeper hands it to the worker's Recorder (the "request finished"
hook: `specx serve` passes store.served.ServedRecorder, which stores it in one transaction) and
now and then asks it to persist the index, with what the learned cost has learned, so that a
restarted server drafts from everything it served. All of it runs on the worker's thread, which
owns the store's connection; a failure is logged and serving goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .events import Choice
from .job import GenerationRequest, now_iso
from .metrics import Stats

log = logging.getLogger("specx.serve")

PERSIST_EVERY = 16  # requests between index saves while busy (a save costs ~0.1 s per 350k tokens)
PERSIST_IDLE_S = 10.0  # save after this long with unsaved requests and nothing queued


class Recorder(Protocol):
    """Where finished requests go, called on the worker's thread only: `open` when the thread
    starts, `record` after each answered request (True when it was stored), `persist` to save the
    global index (every PERSIST_EVERY records and when idle; False: it failed, try again later),
    `close` when the thread ends. A failure is the recorder's to log: the worker keeps serving (and
    logs what a recorder raises all the same: the answer still goes out)."""

    def open(self) -> None: ...

    def record(self, request: GenerationRequest, choices: list[Choice], stats: Stats, started_at: str,
               ended_at: str) -> bool: ...

    def persist(self) -> bool: ...

    def close(self) -> None: ...


def record_answer(recorder: Recorder, req: GenerationRequest, choices: list[Choice], stats: Stats, started_at: str,
                  debug: bool = False) -> bool:
    """Hand a finished request to `recorder`; what it raises is logged, and the answer still goes out."""
    try:
        return bool(recorder.record(req, choices, stats, started_at, now_iso()))
    except Exception as exc:  # noqa: BLE001 - a recorder's failure must not cost the answer or the worker
        log.error("%s: could not store the request: %s: %s", req.id, type(exc).__name__, exc, exc_info=debug)
        return False


class Keeper:
    """The worker's `recorder` (None: nothing is kept but the global index in memory) and when it
    persists: after PERSIST_EVERY stored requests, PERSIST_IDLE_S after the last one when nothing
    is queued, and when the thread ends. `save_cost` keeps what the learned cost has learned, with
    the index. `debug`: log tracebacks."""

    def __init__(self, recorder: Recorder | None = None, save_cost: Callable[[], None] | None = None,
                 debug: bool = False) -> None:
        self.recorder = recorder
        self.save_cost = save_cost
        self.debug = debug
        self.unsaved = 0  # requests stored since the index was last persisted
        self.saved_at = time.monotonic()

    def open(self) -> None:
        """On the worker's thread: a store's connection belongs to the thread that opens it."""
        if self.recorder is None:
            return
        try:
            self.recorder.open()
        except Exception as exc:  # noqa: BLE001 - answering matters more than storing
            log.error("cannot store answered requests: %s: %s", type(exc).__name__, exc, exc_info=self.debug)
            self.recorder = None

    def record(self, req: GenerationRequest, choices: list[Choice], stats: Stats, started_at: str) -> bool:
        """Store a finished request (~1 ms); whether it was stored."""
        if self.recorder is None or not record_answer(self.recorder, req, choices, stats, started_at, self.debug):
            return False
        self.unsaved += 1
        return True

    @property
    def last_rowids(self) -> Any:
        """The store's rows of the request recorded last (a ServedRecorder's; () for others)."""
        return getattr(self.recorder, "last_rowids", ())

    def due(self, idle: bool = False) -> None:
        """Persist after PERSIST_EVERY stored requests, or (`idle`) PERSIST_IDLE_S after the last."""
        if self.unsaved >= PERSIST_EVERY or (
                idle and self.unsaved and time.monotonic() - self.saved_at >= PERSIST_IDLE_S):
            self.persist()

    def persist(self) -> None:
        self.saved_at = time.monotonic()
        try:
            if self.save_cost is not None:
                self.save_cost()
            if self.recorder is None or self.recorder.persist():
                self.unsaved = 0
        except Exception as exc:  # noqa: BLE001 - tried again later; the worker goes on
            log.error("could not persist the index: %s: %s", type(exc).__name__, exc, exc_info=self.debug)

    def close(self) -> None:
        """The thread ends: persist what is unsaved, close the recorder."""
        if self.unsaved:
            self.persist()
        if self.recorder is not None:
            try:
                self.recorder.close()
            except Exception as exc:  # noqa: BLE001
                log.error("cannot close the store of answered requests: %s: %s", type(exc).__name__, exc)
