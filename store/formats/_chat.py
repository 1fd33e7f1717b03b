"""Chat-message helpers shared by the formats that store OpenAI-style messages.

The output of an assistant turn is rendered as its text content followed by one line per tool
call holding that call's arguments, because the arguments (JSON the model wrote token by token)
are what speculation has to predict; the function names go to `Call.meta["tool_names"]`.

    >>> render_output("Listing files.", [{"function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}])
    ('Listing files.\\n{"cmd": "ls"}', ['bash'])
"""

from __future__ import annotations

import json
from typing import Any


def content_text(content: Any) -> str:
    """Text of a message `content`: a string, or a list of parts whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    return str(content)


def arguments_text(arguments: Any) -> str:
    """A tool call's arguments as the model wrote them: the JSON string as is, or an object re-encoded."""
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def tool_call_parts(tool_call: Any) -> tuple[str, str]:
    """(name, arguments text) of one tool call, OpenAI `{function: {name, arguments}}` or flat `{name, arguments}`."""
    if not isinstance(tool_call, dict):
        return "", ""
    function = tool_call.get("function")
    source = function if isinstance(function, dict) else tool_call
    name = source.get("name")
    return (name if isinstance(name, str) else ""), arguments_text(source.get("arguments"))


def render_output(content: Any, tool_calls: Any) -> tuple[str, list[str]]:
    """The output text of an assistant turn (content, then one arguments line per tool call) and the tool names."""
    parts = []
    text = content_text(content)
    if text:
        parts.append(text)
    names = []
    for tool_call in tool_calls if isinstance(tool_calls, list) else []:
        name, arguments = tool_call_parts(tool_call)
        names.append(name)
        if arguments:
            parts.append(arguments)
    return "\n".join(parts), names


def prompt_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message reduced to `{role, content}`; an assistant's tool calls are kept as rendered text."""
    role = message.get("role")
    role = role if isinstance(role, str) else "user"
    if role == "assistant":
        content, _ = render_output(message.get("content"), message.get("tool_calls"))
    else:
        content = content_text(message.get("content"))
    return {"role": role, "content": content}

