"""OpenAI-style chat logs: request/response records and whole conversations.

Records are read from JSON Lines (one record per line) or from a JSON document holding one
record or a list of them. A record is either

- a request with its response: `{"messages": [...], "response": {...}}` (also `"choices"` at the
  top level, `{"request": {...}, "response": ...}`, and a batch-style `response.body`); one Call
  per choice, prompt = the request's messages; or
- a conversation: `{"messages": [...]}` or `{"conversation": [...]}` (the Spider 2.0 agent
  trajectories); every assistant turn is one Call whose prompt is the messages before it.

An assistant turn's output is its content plus one line per tool call with the arguments, which
may be a JSON string (`function.arguments`) or a JSON object (`{name, arguments: {...}}`);
tool names go to `meta["tool_names"]`. Session id = the record's `session_id`/`instance_id`
(`#rollout_idx` appended when present)/`id`/`custom_id`, else `line-N` or `record-N`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._chat import prompt_message, render_output
from ._source import head_lines, head_text, iter_json_lines, load_json, read_head

_MESSAGES = re.compile(r'"(?:messages|conversation)"\s*:\s*\[\s*\{\s*"(?:role|content|name|tool_calls)"')
_SESSION_KEYS = ("session_id", "instance_id", "id", "custom_id")


def sniff(path: Path, head: bytes) -> bool:
    """JSON (Lines) whose records hold a `messages` or `conversation` list of chat messages."""
    text = head_text(head)
    if text is None or text.lstrip()[:1] not in ("{", "["):
        return False
    return bool(_MESSAGES.search(text))


def read(path: Path) -> Iterator[Call | ParseError]:
    """Calls of a chat-log file: JSON Lines of records, or one JSON document with one or more records."""
    if _is_document(path):
        data = load_json(path)
        records = data if isinstance(data, list) else [data]
        for index, record in enumerate(records):
            yield from _record_calls(record, path, f"record-{index}", line=None)
        return
    for item in iter_json_lines(path):
        if isinstance(item, ParseError):
            yield item
        else:
            number, record = item
            yield from _record_calls(record, path, f"line-{number}", line=number)


def _is_document(path: Path) -> bool:
    """True when the file is one (pretty-printed) JSON document rather than JSON Lines."""
    head = read_head(path)
    text = head_text(head)
    lines = head_lines(text, whole=True) if text is not None else []
    if not lines:
        return False
    first = lines[0].strip()
    return first.startswith("[") or first == "{"


def _session_id(record: dict[str, Any], fallback: str) -> str:
    for key in _SESSION_KEYS:
        value = record.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            if key == "instance_id" and record.get("rollout_idx") is not None:
                return f"{value}#{record['rollout_idx']}"
            return str(value)
    return fallback


def _record_calls(record: Any, path: Path, fallback: str, line: int | None) -> Iterator[Call | ParseError]:
    if not isinstance(record, dict):
        yield ParseError(path, f"{fallback}: record is not a JSON object", line=line)
        return
    request = record.get("request") if isinstance(record.get("request"), dict) else record
    messages = next(
        (value for value in (request.get("messages"), record.get("conversation")) if isinstance(value, list)),
        None,
    )
    if messages is None:
        yield ParseError(path, f"{fallback}: no messages or conversation list", line=line)
        return
    prompt = [prompt_message(message) for message in messages if isinstance(message, dict)]
    session_id = _session_id(record, fallback)
    response = record.get("response")
    if isinstance(response, dict) and isinstance(response.get("body"), dict):
        response = response["body"]  # OpenAI batch output wraps the completion
    model = next(
        (value for value in (record.get("model"), request.get("model"), _get(response, "model")) if isinstance(value, str)),
        None,
    )
    choices = _get(response, "choices") if response is not None else record.get("choices")
    if isinstance(response, str):
        yield Call(session_id=session_id, position=0, output_text=response, prompt_messages=prompt, model=model, line=line)
    elif isinstance(choices, list):
        yield from _choice_calls(choices, path, session_id, prompt, model, line, _get(response, "usage"))
    elif response is not None:
        yield ParseError(path, f"{session_id}: response has no choices", line=line)
    else:
        yield from _conversation_calls(messages, prompt, session_id, model, line)


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def _choice_calls(
    choices: list[Any],
    path: Path,
    session_id: str,
    prompt: list[dict[str, Any]],
    model: str | None,
    line: int | None,
    usage: Any,
) -> Iterator[Call | ParseError]:
    for index, choice in enumerate(choices):
        message = _get(choice, "message")
        if isinstance(message, dict):
            output, tool_names = render_output(message.get("content"), message.get("tool_calls"))
        elif isinstance(_get(choice, "text"), str):
            output, tool_names = choice["text"], []  # legacy completions API
        else:
            yield ParseError(path, f"{session_id}: choice {index} has no message", line=line)
            continue
        meta: dict[str, Any] = {"choice": index}
        if any(tool_names):
            meta["tool_names"] = tool_names
        if len(choices) == 1 and isinstance(_get(usage, "completion_tokens"), int):
            meta["completion_tokens"] = usage["completion_tokens"]
        yield Call(
            session_id=session_id,
            position=index,
            output_text=output,
            prompt_messages=prompt,
            model=model,
            line=line,
            meta=meta,
        )


def _conversation_calls(
    messages: list[Any], prompt: list[dict[str, Any]], session_id: str, model: str | None, line: int | None
) -> Iterator[Call]:
    # `prompt` is `messages` normalised, with non-object entries dropped: walk it, not `messages`.
    originals = [message for message in messages if isinstance(message, dict)]
    position = 0
    for index, message in enumerate(originals):
        if message.get("role") != "assistant":
            continue
        output, tool_names = render_output(message.get("content"), message.get("tool_calls"))
        if not output:
            continue
        meta: dict[str, Any] = {"turn": index}
        if any(tool_names):
            meta["tool_names"] = tool_names
        yield Call(
            session_id=session_id,
            position=position,
            output_text=output,
            prompt_messages=prompt[:index],
            model=model,
            line=line,
            meta=meta,
        )
        position += 1

