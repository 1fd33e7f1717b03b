"""OpenHands completion-log folders: `prompt_NNN.log` / `response_NNN.log` pairs of plain text.

A folder is one session (its path, as given, is the session id); pair NNN, in numeric order, is
one Call with `prompt_text` = the prompt file and `output_text` = the response file.

`read` takes the folder, which yields every pair, or one file of a pair, which yields that pair
only: the same Call (same session id and position) whichever of its two files is named, so a
caller that walks files and keys Calls by content reads each pair once in effect. Passing the
folder is the clean way; the file form exists because tools that walk trees see files.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from ._call import Call, ParseError

_LOG_NAME = re.compile(r"(prompt|response)_(\d+)\.log")


def _log_name(path: Path) -> tuple[str, int] | None:
    match = _LOG_NAME.fullmatch(path.name)
    return (match.group(1), int(match.group(2))) if match else None


def _pairs(folder: Path) -> dict[int, dict[str, Path]]:
    """Files of a folder by pair number: {NNN: {"prompt": path, "response": path}}."""
    pairs: dict[int, dict[str, Path]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return pairs
    for entry in entries:
        name = _log_name(entry)
        if name is not None and entry.is_file():
            pairs.setdefault(name[1], {})[name[0]] = entry
    return pairs


def is_log_folder(path: Path) -> bool:
    """True for a folder holding at least one complete prompt/response pair."""
    return path.is_dir() and any(len(files) == 2 for files in _pairs(path).values())


def is_log_file(path: Path) -> bool:
    """True for `prompt_NNN.log` / `response_NNN.log` whose partner file sits beside it."""
    name = _log_name(path)
    if name is None or not path.is_file():
        return False
    partner = "response" if name[0] == "prompt" else "prompt"
    return (path.parent / f"{partner}_{path.name.split('_', 1)[1]}").is_file()


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ParseError(path, f"not UTF-8 text (bad byte at offset {error.start})") from None
    except OSError as error:
        raise ParseError(path, f"cannot read: {error.strerror or error}") from None


def read(path: Path) -> Iterator[Call | ParseError]:
    """Calls of a completion-log folder, or of the one pair that a prompt/response file belongs to."""
    if not path.exists():
        raise ParseError(path, "no such file or folder")
    folder = path if path.is_dir() else path.parent
    pairs = _pairs(folder)
    numbers = sorted(pairs)
    if path.is_dir():
        wanted = numbers
    else:
        name = _log_name(path)
        if name is None:
            raise ParseError(path, "not a prompt_NNN.log / response_NNN.log file")
        wanted = [name[1]]
    if not wanted:
        raise ParseError(path, "no prompt_NNN.log / response_NNN.log files")
    num_ok = 0
    num_bad = 0
    for number in wanted:
        files = pairs.get(number, {})
        if len(files) != 2:
            have = next(iter(files.values()), folder)
            missing = "response" if "prompt" in files else "prompt"
            num_bad += 1
            yield ParseError(have, f"no matching {missing}_{have.name.split('_', 1)[1]}")
            continue
        try:
            prompt = _read_text(files["prompt"])
            output = _read_text(files["response"])
        except ParseError as error:
            num_bad += 1
            yield error
            continue
        num_ok += 1
        yield Call(
            session_id=folder.name,  # the source's real path scopes it: how the path was typed must not matter
            position=numbers.index(number),
            output_text=output,
            prompt_text=prompt,
            meta={"log_number": number},
        )
    if num_ok == 0:
        raise ParseError(path, f"no readable prompt/response pair ({num_bad} bad)")
