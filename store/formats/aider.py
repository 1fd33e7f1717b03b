"""Aider chat transcripts (`.aider.chat.history.md`).

The file is Markdown appended to by every aider run:

    # aider chat started at 2024-08-05 10:11:12
    > Main model: gpt-4o with diff edit format      (aider's own notes: `> ` lines)
    #### add a hello function                       (the user: `#### ` lines)
    Here is the change: ...                         (the assistant: everything else)

Each run is a session (id = its start time); each non-empty assistant reply is one Call whose
prompt is the run's earlier user and assistant messages. The model comes from the run's
`> Model:` / `> Main model:` / `> Models:` note when there is one. Aider's notes inside a reply
(`> Applied edit to ...`) are not model output and are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._source import head_text

_STARTED = re.compile(r"^# aider chat started at (.+?)\s*$")
_MODEL_NOTE = re.compile(r"^> (?:Main model|Models?): (\S+)")


def sniff(path: Path, head: bytes) -> bool:
    """Markdown with aider's `# aider chat started at` header."""
    text = head_text(head)
    return text is not None and any(_STARTED.match(line) for line in text.splitlines()[:200])


def read(path: Path) -> Iterator[Call | ParseError]:
    """One Call per assistant reply of each aider run in the file."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ParseError(path, f"not UTF-8 text (bad byte at offset {error.start})") from None
    except OSError as error:
        raise ParseError(path, f"cannot read: {error.strerror or error}") from None
    if not text.strip():
        raise ParseError(path, "empty file")
    session = _Session(None, 1)
    for number, line in enumerate(text.splitlines(), start=1):
        started = _STARTED.match(line)
        if started:
            call = session.end_reply()
            session = _Session(started.group(1), number)
        else:
            call = session.add(line, number)
        if call is not None:
            yield call
    call = session.end_reply()
    if call is not None:
        yield call


class _Session:
    """One aider run: user lines, the reply being read, and the messages so far."""

    def __init__(self, started: str | None, line: int) -> None:
        self.session_id = started or f"line-{line}"
        self.started_at = started.replace(" ", "T", 1) if started else None
        self.model: str | None = None
        self.messages: list[dict[str, Any]] = []
        self.user: list[str] = []
        self.reply: list[str] = []
        self.reply_line: int | None = None
        self.position = 0

    def add(self, line: str, number: int) -> Call | None:
        """Take one line; returns the reply it ends, if any."""
        if line.startswith("#### ") or line == "####":
            call = self.end_reply()
            self.user.append(line[5:].rstrip())
            return call
        if line.startswith("> ") or line == ">":
            model = _MODEL_NOTE.match(line)
            if model and self.model is None:
                self.model = model.group(1)
            return None
        if self.user:
            self.messages.append({"role": "user", "content": "\n".join(self.user).strip()})
            self.user = []
        if self.reply_line is None and line.strip():
            self.reply_line = number
        self.reply.append(line.rstrip())
        return None

    def end_reply(self) -> Call | None:
        """The reply read so far as a Call (None when it is empty), appended to the messages."""
        output = "\n".join(self.reply).strip()
        line = self.reply_line
        self.reply = []
        self.reply_line = None
        if not output:
            return None
        call = Call(
            session_id=self.session_id,
            position=self.position,
            output_text=output,
            prompt_messages=list(self.messages),
            model=self.model,
            started_at=self.started_at,
            line=line,
        )
        self.position += 1
        self.messages.append({"role": "assistant", "content": output})
        return call
