"""Bounds on a request's input, checked before any tokenizer sees it: lone surrogates (not text)
are refused anywhere in a body, and text too long to ever fit the model's context is refused
untokenized. requests.py calls these for each body.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ApiError

PREDICTION_CHARS_PER_TOKEN = 16  # a prediction longer than this many characters per context token is refused unread
PROMPT_CHARS_PER_TOKEN = 16  # so is a prompt (messages and tools together): it could never fit the context


LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_lone_surrogates(body: Any) -> None:
    """A lone surrogate (JSON's "\\ud800" escape without its pair) anywhere in the body, keys
    included, is not text: UTF-8 cannot encode it, so no tokenizer, store or error message can
    take it. A 400 naming where it is (e.g. 'stop.[0]', 'messages.[1].content'), first in the body's order.

    >>> refuse_lone_surrogates({"stop": ["ok", "\\ud800"]})
    Traceback (most recent call last):
    ...
    specx.http.errors.ApiError: Invalid 'stop.[1]': it holds a lone surrogate (U+D800), which is not text
    """
    stack: list[tuple[Any, str | None]] = [(body, None)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            found = LONE_SURROGATE.search(value)
            if found:
                raise ApiError(400, f"Invalid '{where}': it holds a lone surrogate (U+{ord(found.group()):04X}), "
                                    "which is not text", where, "invalid_value")
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                name = key if LONE_SURROGATE.search(key) is None else key.encode("utf-8", "backslashreplace").decode()
                path = name if where is None else f"{where}.{name}"
                if name != key:
                    raise ApiError(400, f"Invalid key '{path}': it holds a lone surrogate, which is not text", path,
                                   "invalid_value")
                children.append((item, path))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.[{i}]") for i, item in reversed(list(enumerate(value))))


def bound_prompt_chars(messages: Any, tools: Any, context_length: int) -> None:
    """Refuse, before any tokenizer sees them, chat messages (their text: content and other fields)
    and tools longer than PROMPT_CHARS_PER_TOKEN characters per token of the model's context: they
    could never fit it, and tokenizing megabytes takes gigabytes (three 30 MB prompts once took
    the server to 8.7 GB and held up every other request for a minute)."""
    used = _text_chars(messages)
    bound_chars("messages", used, context_length)
    if tools is not None:
        bound_chars("tools", used + _text_chars(tools), context_length, " (with the messages)")


def bound_chars(param: str, chars: int, context_length: int, note: str = "") -> None:
    """Refuse `chars` characters of `param` past PROMPT_CHARS_PER_TOKEN per token of the context."""
    limit = PROMPT_CHARS_PER_TOKEN * context_length
    if chars > limit:
        raise ApiError(400, f"'{param}' takes {chars:,} characters{note}, more than {limit:,} "
                            f"({PROMPT_CHARS_PER_TOKEN} per token of this model's context of {context_length:,} "
                            f"tokens): it cannot fit; refused before tokenizing", param, "context_length_exceeded")


def bound_ids(param: str, count: int, context_length: int) -> None:
    """Refuse more token ids than the model's context, before they are checked or decoded: no
    prompt or answer holds more, and /detokenize of 15 million once took the server to 4.5 GB
    and held /health for 12 s."""
    if count > context_length:
        raise ApiError(400, f"'{param}' holds {count:,} token ids, more than this model's context of "
                            f"{context_length:,} tokens: refused before decoding", param, "context_length_exceeded")


def _text_chars(value: Any) -> int:
    """The characters of every string (keys included) in a JSON value, counted without recursion."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total
