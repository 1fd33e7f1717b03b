"""OpenHands (formerly OpenDevin) logs, in four shapes read by one format name.

- evaluation `output.jsonl`, 2025 event schema: one run per line, `history` = list of events.
  Each agent action carrying `tool_call_metadata` holds the raw completion in
  `tool_call_metadata.model_response`; one completion can drive several actions, so Calls are
  deduplicated on `model_response.id`. Output = message content + one arguments line per tool
  call (see `_chat.render_output`). The prompt is not stored verbatim: it is rebuilt, best
  effort, as the system event plus the earlier events as messages (user messages, earlier
  outputs, observations as `tool` or `user` messages; recall events are left out).
- the older OpenDevin `output.jsonl`: `history` = list of `[action, observation]` pairs, no raw
  completion; output = `args.thought` + `args.code`/`command`, or a message's content.
- runtime trajectories: a bare JSON list of events (same schema), where `tool_call_metadata`
  may be a Python-repr string; it is parsed with `ast.literal_eval`, which builds literals only.
- completion-log folders (`prompt_NNN.log` / `response_NNN.log`): see `_openhands_logs`.

Session id: `instance_id` (or the old `id`), the file stem for a runtime trajectory, the folder
path for a completion-log folder. Position: order of the Call within its run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._call import Call, ParseError
from ._chat import content_text, render_output
from ._openhands_logs import is_log_file, is_log_folder
from ._openhands_logs import read as read_log_folder
from ._source import head_text, iter_json_lines, json_or_repr, load_json, read_head

_EVENT_SOURCE = re.compile(r'"source"\s*:\s*"(agent|user|environment)"')
_EVENT_KIND = re.compile(r'"(action|observation)"\s*:\s*"')
_HISTORY = re.compile(r'"history"\s*:\s*\[')
# Old pair-schema actions whose arguments carry what the model wrote, besides its thought.
_CODE_ARGS = ("code", "command", "browser_actions")
# Observations that are bookkeeping, never shown to the model as such.
_HIDDEN_OBSERVATIONS = {"recall", "null", "agent_state_changed"}


def sniff(path: Path, head: bytes) -> bool:
    """OpenHands output.jsonl, runtime event list, or a completion-log folder/file."""
    if path.is_dir():
        return is_log_folder(path)
    if is_log_file(path):
        return True
    text = head_text(head)
    if text is None:
        return False
    start = text.lstrip()[:1]
    if start == "{":
        # Runs start with instance_id/instruction/metadata; history may begin past the head
        # when an early field is huge, so the metadata's agent_class also counts. Events (with
        # a source) keep instruction-tuning data ({instruction, output, history}) out.
        has_events = bool(_HISTORY.search(text)) and bool(_EVENT_SOURCE.search(text))
        return '"instruction"' in text and (has_events or '"agent_class"' in text)
    if start == "[":
        return bool(_EVENT_SOURCE.search(text)) and bool(_EVENT_KIND.search(text)) and '"timestamp"' in text
    return False


def read(path: Path) -> Iterator[Call | ParseError]:
    """Calls of an OpenHands log: output.jsonl, runtime event list, or completion-log folder/file."""
    if path.is_dir() or is_log_file(path):
        yield from read_log_folder(path)
        return
    text = head_text(read_head(path, 4096))
    if text is not None and text.lstrip().startswith("["):
        yield from _read_event_list(path)
    else:
        yield from _read_output_jsonl(path)


def _read_event_list(path: Path) -> Iterator[Call | ParseError]:
    events = load_json(path)
    if not isinstance(events, list):
        raise ParseError(path, "expected a JSON list of OpenHands events")
    yield from _calls_from_events(events, path, session_id=path.stem, model=None, line=None)


def _read_output_jsonl(path: Path) -> Iterator[Call | ParseError]:
    for item in iter_json_lines(path):
        if isinstance(item, ParseError):
            yield item
            continue
        number, record = item
        if not isinstance(record, dict) or not isinstance(record.get("history"), list):
            yield ParseError(path, "not an OpenHands run (no history list)", line=number)
            continue
        session_id = str(record.get("instance_id", record.get("id", f"line-{number}")))
        model = _metadata_model(record.get("metadata"))
        history = record["history"]
        if any(isinstance(entry, list) for entry in history):
            yield from _calls_from_pairs(history, path, session_id, model, number)
        else:
            yield from _calls_from_events(history, path, session_id, model, number)


def _metadata_model(metadata: Any) -> str | None:
    """Model name from a run's metadata: `llm_config.model` (2025) or `model_name` (2024)."""
    if isinstance(metadata, str):
        try:
            metadata = json_or_repr(metadata)
        except ValueError:
            return None
    if not isinstance(metadata, dict):
        return None
    llm_config = metadata.get("llm_config")
    if isinstance(llm_config, dict) and isinstance(llm_config.get("model"), str):
        return llm_config["model"]
    name = metadata.get("model_name")
    return name if isinstance(name, str) else None


def _event_text(event: dict[str, Any]) -> str:
    """What an action says: `args.content` when present, else its `message`."""
    args = event.get("args")
    if isinstance(args, dict) and args.get("content"):
        return content_text(args["content"])
    return content_text(event.get("message"))


def _event_message(event: dict[str, Any]) -> dict[str, Any] | None:
    """An event (that is not an LLM output) as a prompt message, or None when the model never saw it."""
    if "action" in event:
        action = event.get("action")
        if action == "system":
            return {"role": "system", "content": _event_text(event)}
        if action == "message" and event.get("source") == "user":
            return {"role": "user", "content": _event_text(event)}
        return None
    observation = event.get("observation")
    if observation is None or observation in _HIDDEN_OBSERVATIONS:
        return None
    role = "tool" if event.get("tool_call_metadata") is not None else "user"
    return {"role": role, "content": content_text(event.get("content"))}


def _model_response(metadata: Any) -> dict[str, Any]:
    """The raw completion inside `tool_call_metadata` (a dict, or a JSON/Python-repr string)."""
    if isinstance(metadata, str):
        metadata = json_or_repr(metadata)
    response = metadata.get("model_response") if isinstance(metadata, dict) else None
    if not isinstance(response, dict):
        raise ValueError("tool_call_metadata has no model_response object")
    return response


def _calls_from_events(
    events: list[Any], path: Path, session_id: str, model: str | None, line: int | None
) -> Iterator[Call | ParseError]:
    messages: list[dict[str, Any]] = []
    seen: set[str] = set()
    position = 0
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            yield ParseError(path, f"{session_id}: event {index} is not an object", line=line)
            continue
        is_agent_action = "action" in event and event.get("source") == "agent"
        if is_agent_action and event.get("tool_call_metadata") is not None:
            try:
                response = _model_response(event["tool_call_metadata"])
            except ValueError as error:
                yield ParseError(path, f"{session_id}: event {event.get('id', index)}: {error}", line=line)
                continue
            response_id = response.get("id")
            if response_id in seen:
                continue  # a later action driven by the same completion
            if response_id is not None:
                seen.add(response_id)
            choices = response.get("choices")
            message = choices[0].get("message") if isinstance(choices, list) and choices else None
            message = message if isinstance(message, dict) else {}
            output, tool_names = render_output(message.get("content"), message.get("tool_calls"))
            usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
            meta = {"response_id": response_id, "tool_names": tool_names}
            if usage.get("completion_tokens") is not None:
                meta["completion_tokens"] = usage["completion_tokens"]
            call_model = response.get("model") if isinstance(response.get("model"), str) else model
        elif is_agent_action and event.get("action") == "message":
            # A reply without tool calls is an LLM output too, though no raw completion is kept.
            output, meta, call_model = _event_text(event), {}, model
        else:
            prompt_message = _event_message(event)
            if prompt_message is not None:
                messages.append(prompt_message)
            continue
        if output:
            yield Call(
                session_id=session_id,
                position=position,
                output_text=output,
                prompt_messages=list(messages),
                model=call_model,
                ended_at=event.get("timestamp"),
                line=line,
                meta=meta,
            )
            position += 1
        messages.append({"role": "assistant", "content": output})


def _pair_output(action: dict[str, Any]) -> str:
    """What the model wrote for an old OpenDevin action (canned `message` texts are left out)."""
    args = action.get("args") if isinstance(action.get("args"), dict) else {}
    if action.get("action") == "message":
        return _event_text(action)
    parts = [content_text(args.get("thought"))]
    parts += [content_text(args.get(key)) for key in _CODE_ARGS]
    return "\n".join(part for part in parts if part)


def _calls_from_pairs(
    history: list[Any], path: Path, session_id: str, model: str | None, line: int
) -> Iterator[Call | ParseError]:
    messages: list[dict[str, Any]] = []
    position = 0
    for index, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, dict) for x in pair)):
            yield ParseError(path, f"{session_id}: history entry {index} is not an [action, observation] pair", line=line)
            continue
        action, observation = pair
        if action.get("source") == "agent" and "action" in action:
            output = _pair_output(action)
            if output:
                yield Call(
                    session_id=session_id,
                    position=position,
                    output_text=output,
                    prompt_messages=list(messages),
                    model=model,
                    ended_at=action.get("timestamp"),
                    line=line,
                    meta={"action": action.get("action")},
                )
                position += 1
                messages.append({"role": "assistant", "content": output})
        elif action.get("action") == "message":
            messages.append({"role": "user", "content": _event_text(action)})
        if observation.get("observation") not in _HIDDEN_OBSERVATIONS | {None}:
            messages.append({"role": "user", "content": content_text(observation.get("content"))})
