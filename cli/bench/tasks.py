"""Recorded agent tasks as `specx bench tasks` replays them: each task's turns in recorded order.

A *task* is one session of the store (a SWE-agent trajectory, an OpenHands instance, an MMSQL
dialogue, a chat log's conversation: `Call.session_id`, kept as `sessions.session_key`), and its
*turns* are its calls in recorded order (`Call.position`). A turn is the conversation the agent
sent for that answer (the call's prompt messages) and the answer it got; calls without a prompt
(one-SQL-per-line predictions) are not turns. Tasks come from a store (`iter_store_tasks`) or
straight from a folder of logs (`iter_log_tasks`), read by the same format readers as ingest.

    >>> rows = [("t1", 1, [{"role": "user", "content": "b"}], "B"), ("t2", 0, [{"role": "user", "content": "x"}], "X"),
    ...         ("t1", 0, [{"role": "user", "content": "a"}], "A"), ("t1", 2, None, "no prompt")]
    >>> [(t.key, [turn.answer for turn in t.turns]) for t in group_calls(rows)]
    [('t1', ['A', 'B']), ('t2', ['X'])]

`cut` fits a task into a context: each turn asks for max_tokens = the recorded answer's length
in tokens, at most the cap, and the task ends before the first turn whose prompt plus that does
not fit (later turns resend an even longer conversation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")  # what every OpenAI-compatible server takes without tool-call ids


@dataclass(frozen=True)
class Turn:
    """One answer of a task: the chat messages sent for it and the answer recorded."""

    messages: Messages
    answer: str
    prompt_tokens: int = 0  # set by cut(): the messages through the chat template, the assistant's turn opened
    max_tokens: int = 0  # set by cut(): the recorded answer's length in tokens, at most the cap


@dataclass
class Task:
    key: str  # where it came from: format, log file name, session key
    turns: list[Turn] = field(default_factory=list)
    needs_tokens: int | None = None  # set by cut(): prompt + max_tokens of the first turn left out


def wire_messages(messages: Sequence[dict[str, Any]]) -> Messages:
    """Recorded messages as any OpenAI-compatible server takes them: {role, content} with a text
    content; a role other than system/user/assistant (a tool's output, a plain-text prompt) is
    sent as the user's, since a `tool` message needs the tool-call id logs rarely keep.

    >>> wire_messages([{"role": "tool", "content": [{"type": "text", "text": "ok"}], "name": "bash"}])
    [{'role': 'user', 'content': 'ok'}]
    """
    from ..store.formats._chat import content_text

    out = []
    for message in messages:
        role = message.get("role")
        out.append({"role": role if role in ROLES else "user", "content": content_text(message.get("content"))})
    return out


def group_calls(rows: Iterable[tuple[str, int, Sequence[dict[str, Any]] | None, str]]) -> list[Task]:
    """Tasks from (task key, position, prompt messages or None, answer) rows: one per key, in the
    order keys first appear, turns sorted by position (ties keep the rows' order); rows without
    prompt messages are left out, and so is a task left with no turn."""
    grouped: dict[str, list[tuple[int, int, Turn]]] = {}
    for order, (key, position, messages, answer) in enumerate(rows):
        if messages:
            grouped.setdefault(key, []).append((position, order, Turn(wire_messages(messages), answer)))
    return [Task(key, [turn for _, _, turn in sorted(turns, key=lambda t: t[:2])]) for key, turns in grouped.items()]


def iter_store_tasks(store: Any) -> Iterator[Task]:
    """The tasks of a store (store.db.Store), a session at a time, in the order they were ingested."""
    sessions = store.db.execute(
        "SELECT s.id, s.format, src.path, s.session_key FROM sessions s JOIN sources src ON src.id = s.source_id"
        " ORDER BY s.id").fetchall()
    for session_id, fmt, path, session_key in sessions:
        calls = store.db.execute("SELECT id, position FROM calls WHERE session_id = ? AND prompt_pack IS NOT NULL"
                                 " ORDER BY position, id", [session_id]).fetchall()
        rows = [(f"{fmt}:{Path(path).name}:{session_key}", position, store.call_prompt(cid), store.call_output(cid))
                for cid, position in calls]
        yield from group_calls(rows)


def iter_log_tasks(paths: Sequence[Path], on_error: Callable[[str], None] = lambda message: None) -> Iterator[Task]:
    """The tasks of log files and folders (searched as `specx ingest` searches them), a file at a
    time; files no format reads, and malformed records, go to `on_error` and are left out."""
    from ..store.formats import ParseError, find_logs, read_calls

    for root in paths:
        for path, fmt in find_logs([root], on_error=lambda p, message: on_error(f"{p}: {message}")):
            if fmt is None:
                continue
            try:
                calls = [c for c in read_calls(path, fmt, root=root) if not isinstance(c, ParseError)]
            except (ParseError, OSError) as exc:
                on_error(str(exc))
                continue
            yield from group_calls((f"{fmt}:{path.name}:{c.session_id}", c.position, c.prompt_messages or (
                [{"role": "user", "content": c.prompt_text}] if c.prompt_text else None), c.output_text) for c in calls)


def cut(task: Task, context: int, max_tokens: int, prompt_tokens: Callable[[Messages], int],
        answer_tokens: Callable[[str], int]) -> Task:
    """`task` with each turn's prompt_tokens and max_tokens (the answer's tokens, 1 to `max_tokens`),
    ending before the first turn whose prompt plus max_tokens passes `context` tokens.

    >>> words = lambda text: len(text.split())
    >>> task = Task("t", [Turn([{"role": "user", "content": "a b"}], "x y z"),
    ...                   Turn([{"role": "user", "content": "a b c d e f"}], "x")])
    >>> [(t.prompt_tokens, t.max_tokens) for t in cut(task, 6, 2, lambda m: words(m[0]["content"]), words).turns]
    [(2, 2)]
    """
    kept = []
    for turn in task.turns:
        n_prompt = prompt_tokens(turn.messages)
        n_max = max(1, min(max_tokens, answer_tokens(turn.answer)))
        if n_prompt + n_max > context:
            return Task(task.key, kept, needs_tokens=n_prompt + n_max)
        kept.append(dataclasses.replace(turn, prompt_tokens=n_prompt, max_tokens=n_max))
    return Task(task.key, kept)


def clip(task: Task, chars: int | None) -> Task:
    """`task` with every message's text cut to its first `chars` characters (None: as it is): the same
    cut at every turn, so the turns still share their conversation's prefix (long demonstrations in
    SWE-agent's first turns outgrow a small model's context).

    >>> clip(Task("t", [Turn([{"role": "user", "content": "abcdef"}], "x")]), 3).turns[0].messages
    [{'role': 'user', 'content': 'abc'}]
    """
    if chars is None:
        return task
    return Task(task.key, [dataclasses.replace(turn, messages=[{**m, "content": m["content"][:chars]}
                                                               for m in turn.messages]) for turn in task.turns])


def select(tasks: Iterable[Task], limit: int | None, fit: Callable[[Task], Task]) -> tuple[list[Task], list[Task]]:
    """The first `limit` tasks (None: all) with at least one turn once `fit` cut them, and those
    passed over on the way because not even their first turn fitted (turnless, needs_tokens set)."""
    chosen, skipped = [], []
    for task in tasks:
        if limit is not None and len(chosen) >= limit:
            break
        fitted = fit(task)
        if fitted.turns:
            chosen.append(fitted)
        else:
            skipped.append(fitted)
    return chosen, skipped


class TokenCounter:
    """Token counts with a model's tokenizer (a transformers tokenizer): a prompt as its chat
    template renders it with the assistant's turn opened (what a server feeds the model), an answer
    as its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt(self, messages: Messages) -> int:
        from ..core.model.chat import render_prompt

        return self._count(render_prompt(self.tokenizer, messages, generation_prompt=True))

    def answer(self, text: str) -> int:
        return self._count(text)

    def _count(self, text: str) -> int:
        return len(self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's
    default), None for no values.

    >>> round(percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90), 9)  # rank 0.9 * 9 = 8.1: 9 + 0.1 * (10 - 9)
    9.1
    >>> percentile([4.0, 1.0, 3.0], 50)
    3.0
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)
