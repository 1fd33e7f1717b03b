"""What every format reader yields: `Call` (one LLM call from a log) and `ParseError` (a record, or a
whole file, that could not be read).

They live here, apart from the package `__init__` that registers the readers, so the readers can
import them without importing one another; the package re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Call:
    """One LLM call recovered from a log: what was asked and what the model wrote."""

    session_id: str  # stable within the source: trajectory/instance/dialogue id
    position: int  # order of the call within its session, from 0
    output_text: str  # the model's own output (what speculation must predict)
    prompt_messages: list[dict[str, Any]] | None = None  # OpenAI-style [{role, content}, ...]
    prompt_text: str | None = None  # when the prompt is plain text rather than messages
    agent: str | None = None  # role in a multi-agent workflow (Decomposer, Refiner, ...)
    model: str | None = None
    started_at: str | None = None  # ISO-8601 when present
    ended_at: str | None = None
    line: int | None = None  # 1-based line in the source file, for JSON Lines formats
    meta: dict[str, Any] = field(default_factory=dict)


class ParseError(ValueError):
    """A record (or a whole file) that could not be read; names the file and, when known, the line."""

    def __init__(self, path: str, message: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")
