"""Whose history drafts whose request: one global index per scope, kept live with the store.

Without tenants there is one scope ('') holding every stored output, as before tenants. With
tenants (`specx serve --tenant NAME:KEY`) each tenant's requests draft from a scope of its own:
its own history (its logs, its corpora, what its requests taught) and the public corpora, never
another tenant's (docs/security.md). A request's output is learned into its own scope only.

The indexes change on the decoding thread only, between steps (`apply`): other threads hand rows
over (`offer`: what the store's watcher, store/watch.py, read since it last looked) or a rebuilt
index (`replace`: after a removal, or a backlog too large to add between steps). A row this server
learned itself (`learned`) is not added twice.

>>> from specx.core.index.suffix_index import SuffixIndex
>>> scopes = Scopes({"a": SuffixIndex(), "b": SuffixIndex()}, tenants=True)
>>> scopes.offer([(1, "a", [5, 6, 7]), (2, "public", [8, 9])]); scopes.apply()  # tokens added
7
>>> scopes.index("a").count([5, 6]), scopes.index("b").count([5, 6]), scopes.index("b").count([8, 9])
(1, 0, 1)
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..cost.acceptance import AcceptanceModel
from ..cost.guard import DraftGuard
from ..cost.learned import LearnedCost
from ..index.suffix_index import SuffixIndex

log = logging.getLogger("specx.serve")

PUBLIC = "public"  # store/tenants.PUBLIC: rows every scope drafts from
INLINE_TOKENS = 32_768  # at most this many tokens are added between two steps (a few ms; more waits a step)


def drafts_from(scope: str, tenants: bool) -> list[str] | None:
    """The tenants whose rows a scope's index holds (None: all, a server without tenants)."""
    return [scope, PUBLIC] if tenants else None


class Scopes:
    """The global index of each scope, and what is waiting to change them (see the module docstring).
    `tenants`: each scope is a tenant (rows of other tenants go nowhere); else one scope '' takes all."""

    def __init__(self, indexes: dict[str, SuffixIndex], *, tenants: bool) -> None:
        self._indexes = dict(indexes)
        self.tenants = tenants
        self._lock = threading.Lock()
        self._rows: deque[tuple[int, str, np.ndarray]] = deque()  # (rowid, tenant, tokens) waiting to be added
        self._swaps: list[tuple[str, SuffixIndex, int]] = []  # (scope, rebuilt index, rows it holds up to)
        self._own: dict[int, SuffixIndex] = {}  # rowid of a row this server learned -> the index it went into
        self._floor: dict[str, int] = {}  # a scope's index holds every row up to this rowid (rebuilt)
        self.rows_added = 0
        self.rebuilds = 0

    @property
    def names(self) -> list[str]:
        return list(self._indexes)

    def index(self, scope: str) -> SuffixIndex:
        """The index a request of `scope` drafts from now."""
        return self._indexes[scope]

    @property
    def num_tokens(self) -> int:
        return sum(int(index.num_tokens) for index in self._indexes.values())

    def scopes_of(self, tenant: str) -> list[str]:
        """The scopes a stored row of `tenant` drafts in."""
        if not self.tenants or tenant == PUBLIC:
            return list(self._indexes)
        return [tenant] if tenant in self._indexes else []

    def tenants_of(self, scope: str) -> list[str] | None:
        return drafts_from(scope, self.tenants)

    # ---- any thread

    def offer(self, rows: Iterable[tuple[int, str, Sequence[int]]]) -> None:
        """Rows read from the store, to be added between steps."""
        with self._lock:
            self._rows.extend((int(r), t, np.asarray(tokens, dtype=np.int32)) for r, t, tokens in rows)

    def replace(self, scope: str, index: SuffixIndex, upto_rowid: int) -> None:
        """A rebuilt index of `scope` holding every row up to `upto_rowid`: swapped in between steps."""
        with self._lock:
            self._swaps.append((scope, index, int(upto_rowid)))

    def pending_tokens(self) -> int:
        with self._lock:
            return sum(len(t) for _, _, t in self._rows)

    # ---- the decoding thread

    def learned(self, scope: str, rowids: Iterable[int]) -> None:
        """Rows this server stored after learning them into `scope`'s index itself."""
        index = self._indexes.get(scope)
        if index is not None:
            for rowid in rowids:
                self._own[int(rowid)] = index

    def apply(self, budget: int = INLINE_TOKENS) -> int:
        """Swap in rebuilt indexes, then add waiting rows, up to `budget` tokens (the rest waits for
        the next step); the number of tokens added."""
        if not self._rows and not self._swaps:
            return 0
        with self._lock:
            swaps, self._swaps = self._swaps, []
            rows, taken = [], 0
            while self._rows and (taken == 0 or taken + len(self._rows[0][2]) <= budget):
                rows.append(self._rows.popleft())
                taken += len(rows[-1][2])
        for scope, index, upto in swaps:
            if scope in self._indexes:
                self._indexes[scope] = index
                self._floor[scope] = max(self._floor.get(scope, 0), upto)
                self.rebuilds += 1
        added = 0
        by_scope: dict[str, list[np.ndarray]] = {}
        for rowid, tenant, tokens in rows:
            own = self._own.pop(rowid, None)
            for scope in self.scopes_of(tenant):
                current = self._indexes[scope]
                if rowid <= self._floor.get(scope, 0) or own is current:
                    continue  # already in it: rebuilt with it, or learned by this server
                by_scope.setdefault(scope, []).append(tokens)
        for scope, seqs in by_scope.items():
            self._indexes[scope].add_many(seqs)
            added += sum(len(s) for s in seqs)
        self.rows_added += len(rows)
        return added


def tenant_prefix_caches(engine: Any, shared: Any, scopes: Scopes | None) -> dict[str, Any] | None:
    """With tenants, a prefix cache per tenant, sharing the one cache's budget: a prompt prefix
    another tenant sent would otherwise be prefilled faster, which the time to the first token
    shows (docs/security.md). None: the shared cache serves every request."""
    if scopes is None or not scopes.tenants or shared is None or not hasattr(shared, "max_tokens"):
        return None
    share = max(1, int(shared.max_tokens) // max(1, len(scopes.names)))
    return {name: engine.new_prefix_cache(share) for name in scopes.names}


class ScopedDrafter:
    """A request's drafter drafting from its scope's index as it is at each step (a rebuilt index,
    rows added meanwhile), learning into it at the end; `inner` is a SuffixDrafter or a drafter
    holding one (`inner.inner`), forked for this request (its `fork()`)."""

    def __init__(self, inner: Any, scopes: Scopes, scope: str) -> None:
        self.inner, self.scopes, self.scope = inner, scopes, scope

    @property
    def max_spec_tokens(self) -> int:
        return self.inner.max_spec_tokens

    def _current(self) -> None:
        index = self.scopes.index(self.scope)
        drafter = self.inner
        while drafter is not None:
            if hasattr(drafter, "global_index"):
                drafter.global_index = index
            drafter = getattr(drafter, "inner", None)

    def start_request(self, prompt: Sequence[int]) -> None:
        self.scopes.apply()
        self._current()
        self.inner.start_request(prompt)

    def extend(self, tokens: Sequence[int]) -> None:
        self.inner.extend(tokens)

    def speculate(self) -> Any:
        self.scopes.apply()
        self._current()
        return self.inner.speculate()

    def finish_request(self, learn: bool = True) -> None:
        self._current()
        self.inner.finish_request(learn)


class Drafting:
    """What a scope's drafts have taught the server: how often its draft nodes are accepted
    (`acceptance`), whether its drafts pay (`cost`: the server's learned cost judged by the scope's
    own guard; the curve is shared, as it measures the machine) and, batched, whether its rows of
    shared passes pay (`shared_guard`). With tenants each has its own: one tenant's losing drafts
    would otherwise shrink or switch off another's, which its stream's pace shows (docs/security.md).
    Without tenants one serves every request."""

    def __init__(self, cost: Any, *, own: bool, batched: bool, say: Callable[[str], None]) -> None:
        self.acceptance = AcceptanceModel()
        self.cost, self.shared_guard = cost, None
        if own and isinstance(cost, LearnedCost):
            self.cost = cost.with_guard(DraftGuard(cost.shape, say))
            self.shared_guard = DraftGuard(lambda n, context: 1.0, say) if batched else None

    @classmethod
    def of(cls, kept: dict[str, Drafting], scope: str, cost: Any, batched: bool) -> Drafting:
        """`scope`'s in `kept`, made on its first request ('': the one of a server without tenants)."""
        if scope not in kept:
            kept[scope] = cls(cost, own=bool(scope), batched=batched,
                              say=lambda m: log.info("tenant %s: %s", scope, m))
        return kept[scope]
