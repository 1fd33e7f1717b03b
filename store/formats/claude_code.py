"""Claude Code logs: `--output-format stream-json` output and `~/.claude/projects/*.jsonl` transcripts.

Both are JSON Lines of events `{type: system|user|assistant|result|summary, message, session_id
| sessionId, ...}`. Claude Code writes one assistant event per content block, all with the same
`message.id`, so consecutive blocks of one message are joined into one Call: text blocks as is,
each `tool_use` block as its JSON `input` (names in `meta["tool_names"]`); thinking blocks are
left out (often redacted). The prompt is the session's earlier messages: user text, tool results
(as `tool` messages) and earlier outputs. Subagent traffic (`isSidechain`, `parent_tool_use_id`)
is kept apart as its own session, `<session>/<subagent>`, so it does not pollute the main prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._chat import content_text
from ._source import head_records, head_text, iter_json_lines

_EVENT_TYPES = {"system", "user", "assistant", "result", "summary"}
_SESSION_KEY = re.compile(r'"(?:session_id|sessionId)"\s*:\s*"')
_MESSAGE_EVENT = re.compile(r'"type"\s*:\s*"(?:assistant|user)"')


def _is_event(record: Any) -> bool:
    return isinstance(record, dict) and record.get("type") in _EVENT_TYPES and (
        "session_id" in record or "sessionId" in record or record.get("type") == "summary"
    )


def sniff(path: Path, head: bytes) -> bool:
    """JSON Lines of Claude Code events (typed, with a session id)."""
    records = head_records(head)
    if records:
        num_events = sum(1 for record in records if _is_event(record))
        return num_events > 0 and num_events * 2 >= len(records) and any("message" in r for r in records if _is_event(r))
    text = head_text(head)  # a first event longer than the head: only its keys are left to see
    return (
        text is not None
        and text.lstrip().startswith("{")
        and bool(_SESSION_KEY.search(text))
        and bool(_MESSAGE_EVENT.search(text))
        and '"message"' in text
    )


@dataclass
class _Open:
    """An assistant message whose content blocks are still arriving."""

    message_id: Any
    prompt: list[dict[str, Any]]
    insert_at: int
    line: int
    model: str | None
    timestamp: str | None
    parts: list[str] = field(default_factory=list)
    tool_names: list[str] = field(default_factory=list)


@dataclass
class _Session:
    messages: list[dict[str, Any]] = field(default_factory=list)
    position: int = 0
    open: _Open | None = None


def read(path: Path) -> Iterator[Call | ParseError]:
    """One Call per assistant message (its blocks joined) of a Claude Code JSON Lines log."""
    sessions: dict[str, _Session] = {}
    model: str | None = None
    for item in iter_json_lines(path):
        if isinstance(item, ParseError):
            yield item
            continue
        number, record = item
        if not isinstance(record, dict):
            yield ParseError(path, "event is not a JSON object", line=number)
            continue
        kind = record.get("type")
        if kind == "system" and isinstance(record.get("model"), str):
            model = record["model"]
        message = record.get("message")
        if kind not in ("user", "assistant") or not isinstance(message, dict):
            continue
        key = _session_key(record, path)
        session = sessions.setdefault(key, _Session())
        if kind == "user":
            session.messages.append(_user_message(message))
            continue
        message_id = message.get("id")
        if session.open is not None and message_id is not None and session.open.message_id == message_id:
            _add_blocks(session.open, message.get("content"))
            continue
        call = _close(session, key)
        if call is not None:
            yield call
        session.open = _Open(
            message_id=message_id,
            prompt=list(session.messages),
            insert_at=len(session.messages),
            line=number,
            model=message.get("model") if isinstance(message.get("model"), str) else model,
            timestamp=record.get("timestamp") if isinstance(record.get("timestamp"), str) else None,
        )
        _add_blocks(session.open, message.get("content"))
    for key, session in sessions.items():
        call = _close(session, key)
        if call is not None:
            yield call


def _session_key(record: dict[str, Any], path: Path) -> str:
    session = record.get("session_id") or record.get("sessionId") or path.stem
    parent = record.get("parent_tool_use_id")
    if parent:
        return f"{session}/{parent}"
    return f"{session}/sidechain" if record.get("isSidechain") else str(session)


def _add_blocks(open_call: _Open, content: Any) -> None:
    if isinstance(content, str):
        open_call.parts.append(content)
        return
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text" and block.get("text"):
            open_call.parts.append(str(block["text"]))
        elif block.get("type") == "tool_use":
            open_call.tool_names.append(str(block.get("name", "")))
            open_call.parts.append(json.dumps(block.get("input", {}), ensure_ascii=False))


def _close(session: _Session, key: str) -> Call | None:
    """Finish the session's open assistant message: its Call, and its place in later prompts."""
    open_call, session.open = session.open, None
    if open_call is None:
        return None
    output = "\n".join(open_call.parts)
    if not output:
        return None
    # User events that arrived while the message was open come after it in the conversation.
    session.messages.insert(open_call.insert_at, {"role": "assistant", "content": output})
    meta: dict[str, Any] = {"message_id": open_call.message_id}
    if open_call.tool_names:
        meta["tool_names"] = open_call.tool_names
    call = Call(
        session_id=key,
        position=session.position,
        output_text=output,
        prompt_messages=open_call.prompt,
        model=open_call.model,
        ended_at=open_call.timestamp,
        line=open_call.line,
        meta=meta,
    )
    session.position += 1
    return call


def _user_message(message: dict[str, Any]) -> dict[str, Any]:
    """A user event as a prompt message: tool results become `tool` messages."""
    content = message.get("content")
    if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
        texts = [content_text(b.get("content")) for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
        return {"role": "tool", "content": "\n".join(texts)}
    return {"role": "user", "content": content_text(content)}
