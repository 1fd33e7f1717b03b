"""Tool calls in a model's output, as vLLM's parsers read them (core/serve/tools.py has the rest:
the requests' tools, prompts and grammars). The output formats: "hermes" (Qwen2.5, NousResearch
Hermes; also what specx prompts for when the template ignores tools) `<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>` per call; "llama3_json" (Llama 3.1) the whole output `{"name":
..., "parameters": {...}}`, several joined by "; ", optionally after `<|python_tag|>`; "mistral"
`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or the newer `[TOOL_CALLS]name[ARGS]{...}`
per call. Parsing never raises on model output: text that is not well-formed calls stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral")

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_MISTRAL_HEAD = re.compile(r"([a-zA-Z0-9_-]{1,64})(?:\[CALL_ID\]([a-zA-Z0-9]+))?(?:\[ARGS\])?")
_MARKERS = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]"}


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call: `arguments` is the JSON text of an object (json.dumps, ensure_ascii=False)."""

    name: str
    arguments: str
    id: str = field(default_factory=_new_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_parser(parser: str) -> None:
    if parser not in PARSERS:
        raise ValueError(f"unknown tool parser {parser!r}: one of {', '.join(PARSERS)}")


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def call_marker(parser: str) -> str:
    """The text a call starts with, for a streaming server to hold text back from. For
    "llama3_json" it is "{" and counts only as the first non-space character of the output (after
    an optional "<|python_tag|>"): a "{" later in a text answer is not a call."""
    check_parser(parser)
    return _MARKERS[parser]


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str, sep: str | None, cut: bool = False) -> list | None:
    """The JSON values `text` consists of, separated by `sep` (None: exactly one value); `cut`: the
    text was cut short, so a last value that does not parse is left out (the others stand)."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        pos = len(text) - len(text[pos:].lstrip())
        if pos == len(text) and values:  # a trailing separator
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return values if cut and values else None
        values.append(value)
        pos = len(text) - len(text[pos:].lstrip())
        if pos == len(text):
            return values
        if sep is None or not text.startswith(sep, pos):
            return None
        pos += len(sep)


def _call(obj: Any, names: Collection[str] | None, call_id: str | None = None) -> ToolCall | None:
    """A ToolCall from {"name", "arguments" | "parameters", "id"?}, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict) or (names is not None and obj["name"] not in names):
        return None
    call_id = call_id or (obj["id"] if isinstance(obj.get("id"), str) and obj["id"] else None)
    return ToolCall(obj["name"], dumps(arguments), call_id or _new_id())


def _parse_hermes(text: str, names: Collection[str] | None, cut: bool = False) -> tuple[str, list[ToolCall]] | None:
    calls, outside, pos = [], [], 0
    for m in _HERMES_CALL.finditer(text):
        outside.append(text[pos:m.start()])
        call = _call(loads(m.group(1) if m.group(1) is not None else m.group(2)), names)
        if call is None:
            if cut and m.group(2) is not None and calls:  # the last call, cut short: the others stand
                return "".join(outside), calls
            return None
        pos = m.end()
        calls.append(call)
    return "".join(outside) + text[pos:], calls


def _parse_llama3_json(text: str, names: Collection[str] | None, cut: bool = False) -> tuple[str, list[ToolCall]] | None:
    body = text.strip()
    body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
    if not body.lstrip().startswith("{"):
        return None
    values = _json_values(body, ";", cut)
    calls = [_call(obj, names) for obj in values or [None]]
    return None if None in calls else ("", calls)


def _parse_mistral(text: str, names: Collection[str] | None, cut: bool = False) -> tuple[str, list[ToolCall]] | None:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    calls: list[ToolCall | None] = []
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if part.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            items = _json_values(part, None)
            if not items and cut:  # cut short inside the list: the items that are whole
                items = [_json_values(part[1:], ",", cut)]
            if not items or not isinstance(items[0], list) or not items[0]:
                return None
            calls.extend(_call(item, names) for item in items[0])
        else:  # name[ARGS]{...}, also name[CALL_ID]id[ARGS]{...}
            m = _MISTRAL_HEAD.match(part)
            arguments = _json_values(part[m.end():], None) if m else None
            if not arguments:
                return None
            calls.append(_call({"name": m.group(1), "arguments": arguments[0]}, names, m.group(2)))
    return None if None in calls else (text[:start], calls)  # type: ignore[return-value]


def parse_tool_calls(parser: str, text: str, names: Collection[str] | None = None,
                     cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output. With calls, content is the text outside them,
    stripped (None if empty). Without (no call, JSON that does not parse, a name not in `names`),
    the original text unchanged (None if empty) and []. `cut`: the output ended at max_tokens, so
    its last call may be incomplete: that one is dropped and the complete ones are returned.

    >>> parse_tool_calls("hermes", '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call><tool_call>{"na',
    ...                  cut=True)[1][0].name
    'add'
    """
    check_parser(parser)
    parsed = {"hermes": _parse_hermes, "llama3_json": _parse_llama3_json, "mistral": _parse_mistral}[parser](
        text, names, cut)
    if not parsed or not parsed[1]:
        return text or None, []
    return parsed[0].strip() or None, parsed[1]
