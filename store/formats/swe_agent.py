"""SWE-agent trajectories (`.traj`): one JSON object `{environment, trajectory, history, info}`.

One Call per `trajectory[i]`: output = `trajectory[i].response` (the raw completion), prompt =
the `history` messages (role/content) before the i-th non-demonstration assistant message, which
is the chat SWE-agent sent for that step. Session id = the file stem (the instance id).

The model comes from the trajectory's `replay_config` (newer SWE-agent) or from the
`metadata.yaml` of a SWE-bench experiments submission (`name: SWE-agent + gpt-4o-2024-05-13`),
read with a line scan so that no YAML parser is needed; otherwise it is None. That file sits
beside the trajectories, or some levels above them (multi-swe-bench keeps each trajectory in a
folder of its own under the submission's): the nearest one in the trajectory's folder or its
ancestors, up to `root` (the folder being ingested), counts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._chat import content_text
from ._source import head_text, json_or_repr, load_json

_TRAJECTORY = re.compile(r'"trajectory"\s*:\s*\[')
_YAML_MODEL = re.compile(r"^\s*(model|model_name)\s*:\s*(.*?)\s*$")
_YAML_NAME = re.compile(r"^\s*name\s*:\s*(.+?)\s*$")
_YAML_ITEM = re.compile(r"^\s*-\s*(.+?)\s*$")


def sniff(path: Path, head: bytes) -> bool:
    """A JSON object with a `trajectory` list and SWE-agent's history/response/environment keys."""
    text = head_text(head)
    if text is None or not text.lstrip().startswith("{"):
        return False
    # History may start past the head when the trajectory is long; its steps have a response.
    return bool(_TRAJECTORY.search(text)) and any(key in text for key in ('"response"', '"history"', '"environment"'))


def read(path: Path, root: Path | None = None) -> Iterator[Call | ParseError]:
    """One Call per trajectory step of a `.traj` file; `root`: the highest folder to look for
    metadata.yaml in (default: only the trajectory's own folder)."""
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("trajectory"), list):
        raise ParseError(path, "not a SWE-agent trajectory (no trajectory list)")
    history = data.get("history") if isinstance(data.get("history"), list) else []
    history = [message for message in history if isinstance(message, dict)]
    model = _replay_model(data.get("replay_config")) or _metadata_model(_metadata_file(path, root))
    # Where each real assistant turn sits in the history: its prompt is everything before it.
    turn_starts = [
        index for index, message in enumerate(history) if message.get("role") == "assistant" and not _is_demo(message)
    ]
    # Built once and sliced, so the steps of a long trajectory share message objects.
    messages = [_prompt_message(message) for message in history]
    position = 0
    for step, entry in enumerate(data["trajectory"]):
        if not isinstance(entry, dict):
            yield ParseError(path, f"trajectory step {step} is not an object")
            continue
        output = content_text(entry.get("response"))
        if not output:
            continue
        prompt = None
        if step < len(turn_starts):
            prompt = messages[: turn_starts[step]]
        yield Call(
            session_id=path.stem,
            position=position,
            output_text=output,
            prompt_messages=prompt,
            model=model,
            meta={"step": step},
        )
        position += 1


def _is_demo(message: dict[str, Any]) -> bool:
    value = message.get("is_demo")
    return value is True or value == "True"


def _prompt_message(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    return {"role": role if isinstance(role, str) else "user", "content": content_text(message.get("content"))}


def _replay_model(replay_config: Any) -> str | None:
    """`agent.model.name` of a newer trajectory's replay_config (a JSON string or an object)."""
    if isinstance(replay_config, str):
        try:
            replay_config = json_or_repr(replay_config)
        except ValueError:
            return None
    agent = replay_config.get("agent") if isinstance(replay_config, dict) else None
    model = agent.get("model") if isinstance(agent, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    return name if isinstance(name, str) and name else None


def _metadata_file(path: Path, root: Path | None) -> Path | None:
    """The nearest metadata.yaml in the trajectory's folder or its ancestors, up to `root`."""
    folder = path.parent
    top = (root if root is not None else folder).resolve()
    while True:
        candidate = folder / "metadata.yaml"
        if candidate.is_file():
            return candidate
        if folder.resolve() == top or folder == folder.parent:
            return None
        folder = folder.parent


def _metadata_model(path: Path | None) -> str | None:
    """Model from a metadata.yaml: `model:`/`model_name:`, else the part after `+` in `name:`."""
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    name = None
    for index, line in enumerate(lines):
        match = _YAML_MODEL.match(line)
        if match:
            if match.group(2):
                return _unquote(match.group(2))
            # `model:` followed by a list (`tags: model: [- gpt-4o]` in SWE-bench metadata)
            item = _YAML_ITEM.match(lines[index + 1]) if index + 1 < len(lines) else None
            if item:
                return _unquote(item.group(1))
        match = _YAML_NAME.match(line)
        if match and name is None:
            name = _unquote(match.group(1))
    # SWE-bench experiments name submissions "SWE-agent + <model>".
    if name and "+" in name:
        return name.rsplit("+", 1)[1].strip() or None
    return None


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value
