"""MMSQL-style multi-turn text-to-SQL outputs: a JSON list of dialogues `{id, db_name, turns}`.

Turns alternate user `{isuser: true, text}` and assistant turns. An assistant turn of a
multi-agent run holds one field per agent; each non-empty agent output is one Call, `agent`
named, in workflow order:

- `Rewriter` (its text; a dict's `text`), then each of `rewritten_outputs` (the SQL written for
  each rewritten question), both as agent "Rewriter";
- `Detector`: the answerability label ("YES") or the JSON object it returned, re-encoded;
- `Decomposer`: `process`, the chain of thought with sub-questions and SQL (the field may be a
  dict, or a JSON / Python-repr string of one);
- `Refiner`: the repaired SQL (a string, or a dict's `sql`).

`Selector` is the pruned schema passed along (context, not free LLM text) and `predict` is the
final answer assembled from the agents, so neither is a Call. An assistant turn of a one-shot
run (no agent fields) is one Call with output = `predict`.

Prompts are not stored (they were built from the agents' templates and the schema); each Call's
`prompt_messages` is the dialogue so far, the user questions and the earlier final answers, as
the nearest thing kept. The dataset itself (no `predict`) is not claimed by `sniff`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._source import head_text, json_or_repr, load_json

_TURNS = re.compile(r'"turns"\s*:\s*\[')
_AGENT_FIELDS = ("Rewriter", "rewritten_outputs", "Detector", "Decomposer", "Refiner")


def sniff(path: Path, head: bytes) -> bool:
    """A JSON list of dialogues whose assistant turns carry a `predict` (the gold-only dataset has none)."""
    text = head_text(head)
    if text is None or not text.lstrip().startswith("["):
        return False
    return bool(_TURNS.search(text)) and '"isuser"' in text and '"predict"' in text


def read(path: Path) -> Iterator[Call | ParseError]:
    """One Call per agent output (multi-agent runs) or per assistant turn (one-shot runs)."""
    data = load_json(path)
    if not isinstance(data, list):
        raise ParseError(path, "expected a JSON list of dialogues")
    for index, dialogue in enumerate(data):
        if not isinstance(dialogue, dict) or not isinstance(dialogue.get("turns"), list):
            yield ParseError(path, f"dialogue {index} has no turns list")
            continue
        yield from _dialogue_calls(dialogue, index, path)


def _dialogue_calls(dialogue: dict[str, Any], index: int, path: Path) -> Iterator[Call | ParseError]:
    dialogue_id = dialogue.get("id")
    session_id = str(dialogue_id) if dialogue_id is not None else f"dialogue-{index}"
    base_meta = {"db_name": dialogue.get("db_name")} if dialogue.get("db_name") is not None else {}
    history: list[dict[str, Any]] = []
    position = 0
    for turn_index, turn in enumerate(dialogue["turns"]):
        if not isinstance(turn, dict):
            yield ParseError(path, f"dialogue {session_id}: turn {turn_index} is not an object")
            continue
        if turn.get("isuser"):
            history.append({"role": "user", "content": _text(turn.get("text"))})
            continue
        prompt = list(history)
        if any(key in turn for key in _AGENT_FIELDS):
            outputs = list(_agent_outputs(turn))
        else:
            outputs = [(None, _text(turn.get("predict")))]
        for agent, output in outputs:
            if not output.strip():
                continue
            yield Call(
                session_id=session_id,
                position=position,
                output_text=output,
                prompt_messages=prompt,
                agent=agent,
                meta={**base_meta, "turn": turn_index},
            )
            position += 1
        history.append({"role": "assistant", "content": _text(turn.get("predict"))})


def _agent_outputs(turn: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(agent, output) for each agent field of a multi-agent assistant turn, in workflow order."""
    rewriter = _maybe_dict(turn.get("Rewriter"))
    yield "Rewriter", _text(rewriter.get("text")) if isinstance(rewriter, dict) else _text(rewriter)
    for output in turn.get("rewritten_outputs") or []:
        yield "Rewriter", _text(output)
    detector = turn.get("Detector")
    if isinstance(detector, (dict, list)):
        yield "Detector", json.dumps(detector, ensure_ascii=False)
    else:
        yield "Detector", _text(detector)
    decomposer = _maybe_dict(turn.get("Decomposer"))
    yield "Decomposer", _text(decomposer.get("process")) if isinstance(decomposer, dict) else _text(decomposer)
    refiner = _maybe_dict(turn.get("Refiner"))
    yield "Refiner", _text(refiner.get("sql")) if isinstance(refiner, dict) else _text(refiner)


def _maybe_dict(value: Any) -> Any:
    """A dict stored as JSON or Python-repr text becomes the dict; anything else is returned as is."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            parsed = json_or_repr(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)
