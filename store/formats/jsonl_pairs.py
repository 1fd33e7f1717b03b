"""Generic JSON Lines of prompt/output pairs: `{"prompt", "completion"}` or `{"input", "output"}`.

One Call per line: `prompt_text` = prompt/input (after an Alpaca-style `instruction` when there
is one), output = completion/output (a non-string value is JSON-encoded); a list prompt is taken
as chat messages.
Session id = the line's `id`/`session_id` when present, else `line-N`; position 0. `model` is
read from a `model` field when there is one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._chat import prompt_message
from ._source import head_records, head_text, iter_json_lines

_PAIRS = (("prompt", "completion"), ("input", "output"))
# A first line longer than the head cannot be parsed; its first key is the clue left.
_FIRST_KEY = re.compile(r'\s*\{\s*"(?:prompt|input)"\s*:')


def _pair(record: Any) -> tuple[Any, Any] | None:
    if isinstance(record, dict):
        for prompt_key, output_key in _PAIRS:
            if prompt_key in record and output_key in record:
                return record[prompt_key], record[output_key]
    return None


def sniff(path: Path, head: bytes) -> bool:
    """JSON Lines whose records are mostly prompt/completion or input/output pairs."""
    records = head_records(head)
    if records:
        num_pairs = sum(1 for record in records if _pair(record) is not None)
        return num_pairs > 0 and num_pairs * 2 >= len(records)
    text = head_text(head)
    return text is not None and "\n" not in text.strip() and bool(_FIRST_KEY.match(text))


def read(path: Path) -> Iterator[Call | ParseError]:
    """One Call per JSON line holding a prompt/output pair."""
    for item in iter_json_lines(path):
        if isinstance(item, ParseError):
            yield item
            continue
        number, record = item
        pair = _pair(record)
        if pair is None:
            yield ParseError(path, "expected prompt/completion or input/output keys", line=number)
            continue
        prompt, output = pair
        if isinstance(record.get("instruction"), str) and isinstance(prompt, str):
            # Alpaca-style records split the prompt into an instruction and an optional input.
            prompt = "\n\n".join(part for part in (record["instruction"], prompt) if part)
        session = next((record[key] for key in ("id", "session_id") if isinstance(record.get(key), (str, int))), None)
        model = record.get("model")
        yield Call(
            session_id=str(session) if session is not None else f"line-{number}",
            position=0,
            output_text=output if isinstance(output, str) else json.dumps(output, ensure_ascii=False),
            prompt_text=prompt if isinstance(prompt, str) else None,
            prompt_messages=[prompt_message(m) for m in prompt if isinstance(m, dict)] if isinstance(prompt, list) else None,
            model=model if isinstance(model, str) else None,
            line=number,
            meta={},
        )
