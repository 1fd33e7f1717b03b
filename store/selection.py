"""Choosing stored calls (for replay and entropy) and rebuilding their prompts as tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .db import Store


@dataclass(frozen=True)
class CallRef:
    id: int
    session_id: int
    position: int
    source: str  # the log file's path
    format: str
    model: str | None
    agent: str | None
    session_key: str

    def group(self, by: str) -> str:
        """The key this call is reported under for --by: format, source, model, agent or session."""
        value = {"format": self.format, "source": self.source, "model": self.model, "agent": self.agent,
                 "session": self.session_key}[by]
        return value if value is not None else "-"


GROUPS = ("format", "source", "model", "agent", "session")


def select_calls(store: Store, tokenizer_id: int, *, formats: list[str] | None = None,
                 sources: list[str] | None = None, models: list[str] | None = None,
                 agents: list[str] | None = None, sessions: list[str] | None = None,
                 limit: int | None = None, tenants: list[str] | None = None) -> list[CallRef]:
    """Calls with output tokens for the tokenizer, in recorded order (session, then position).

    Filters combine with AND; within one, any value may match (formats and tenants exactly, the
    others as substrings of the source path, model, agent or session key). `tenants` None: every
    tenant's calls; a list (even empty) keeps only the calls of sources in those tenants.
    """
    where, args = ["t.tokenizer_id = ?"], [tokenizer_id]
    if tenants is not None:
        where.append(f"src.tenant IN ({','.join('?' * len(tenants))})")
        args += list(tenants)
    for column, values, exact in (("s.format", formats, True), ("src.path", sources, False),
                                  ("c.model", models, False), ("c.agent", agents, False),
                                  ("s.session_key", sessions, False)):
        if values:
            if exact:
                where.append(f"{column} IN ({','.join('?' * len(values))})")
                args += values
            else:
                where.append("(" + " OR ".join(f"coalesce({column}, '') LIKE ?" for _ in values) + ")")
                args += [f"%{v}%" for v in values]
    condition = " AND ".join(where[1:]) or "1"
    rows = store.db.execute(
        "SELECT c.id, c.session_id, c.position, src.path, s.format, c.model, c.agent, s.session_key"
        " FROM calls c JOIN sessions s ON s.id = c.session_id JOIN sources src ON src.id = s.source_id"
        f" JOIN tokens t ON t.call_id = c.id WHERE t.tokenizer_id = ? AND {condition}"
        " ORDER BY c.session_id, c.position, c.id" + (" LIMIT ?" if limit else ""),
        [tokenizer_id, *args[1:]] + ([limit] if limit else [])).fetchall()
    return [CallRef(*row) for row in rows]


def outside_sessions(store: Store, tokenizer_id: int, selected: list[CallRef],
                     tenants: list[str] | None = None) -> list[CallRef]:
    """Calls of every session none of whose calls is in `selected` (what `replay --warm` preloads),
    of `tenants` only (None: all)."""
    chosen = {c.session_id for c in selected}
    return [c for c in select_calls(store, tokenizer_id, tenants=tenants) if c.session_id not in chosen]


class PromptMessages:
    """The prompt messages of some calls, read from the store once: what prompt rendering and
    tokenization read (`call_prompt_ids`, `message`, `call_prompt`, as Store has them), from
    memory, so that they can run in another thread (a SQLite connection belongs to its thread)."""

    def __init__(self, store: Store, calls: list[CallRef]) -> None:
        self._ids = {c.id: store.call_prompt_ids(c.id) for c in calls}
        wanted = dict.fromkeys(mid for ids in self._ids.values() if ids for mid in ids)
        self._messages = {mid: store.message(mid) for mid in wanted}

    def call_prompt_ids(self, call_id: int) -> list[int] | None:
        return self._ids[call_id]

    def message(self, message_id: int) -> dict[str, Any]:
        return self._messages[message_id]

    def call_prompt(self, call_id: int) -> list[dict[str, Any]] | None:
        ids = self._ids[call_id]
        return None if ids is None else [self._messages[mid] for mid in ids]


def prompt_texts(store: Store | PromptMessages, calls: list[CallRef], render: Any, max_chars: int | None) -> list[tuple[str, bool]]:
    """Each call's prompt rendered as text, from only its last messages worth about `max_chars`
    characters (None: all), and whether messages were left out. A replay keeps the last N tokens
    anyway; rendering and tokenizing a 60-turn history for every call would dominate its time."""
    out = []
    for call in calls:
        messages = store.call_prompt(call.id) or []
        tail, size = [], 0
        for message in reversed(messages):
            if max_chars is not None and size >= max_chars:
                break
            tail.append(message)
            size += len(str(message.get("content", "")))
        out.append((render(tail[::-1]), len(tail) < len(messages)))
    return out
