"""Agent log formats: each module has `sniff(path, head) -> bool` and `read(path) -> Iterator[Call | ParseError]`.

`FORMATS` maps each format name to its module (most specific first); `detect(path)` names the
format of a file from its content, never from the file name alone (the one exception: OpenHands
completion-log folders are known by their `prompt_NNN.log` / `response_NNN.log` pairs);
`read_calls(path)` detects and reads. `read` yields a `ParseError` for a malformed record and
goes on with the rest of the file; it raises `ParseError` only when nothing in the file can be
read (empty, not UTF-8, not valid or truncated JSON, or no readable line at all). `Call` and
`ParseError` are defined in `_call` (which the format modules import) and imported from here.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

from . import aider, claude_code, jsonl_pairs, openai_chat, openhands, sql_lines, swe_agent, text2sql
from ._call import Call, ParseError
from ._source import read_head

# Most specific first: detect() returns the first format whose sniffer claims the file. The
# loose text heuristics (aider's header, SQL lines) come last.
FORMATS: dict[str, ModuleType] = {
    "openhands": openhands,
    "swe-agent": swe_agent,
    "text2sql-multiagent": text2sql,
    "claude-code": claude_code,
    "openai-chat": openai_chat,
    "jsonl-pairs": jsonl_pairs,
    "aider": aider,
    "sql-lines": sql_lines,
}


def detect(path: Path) -> str | None:
    """Name of the format of a log file (or OpenHands completion-log folder), None when unknown."""
    path = Path(path)
    head = read_head(path)
    for name, module in FORMATS.items():
        try:
            if module.sniff(path, head):
                return name
        except (OSError, ValueError):
            continue  # a sniffer that trips on odd content must not stop the others
    return None


# Formats whose logs take metadata from enclosing folders (SWE-agent's metadata.yaml): their
# read() also accepts `root`, the highest folder to look in.
READS_ENCLOSING_FOLDERS = ("swe-agent",)


def read_calls(path: Path, format: str | None = None, root: Path | None = None) -> Iterator[Call | ParseError]:
    """Calls (and per-record ParseErrors) of a log, its format detected unless `format` names one.

    `root` is the folder the log was found under (the one a user named): formats that read
    metadata from enclosing folders look no higher; by default they look only beside the log.
    Raises ParseError (naming the file) when the format cannot be detected, and ValueError when
    `format` is not a known format name. Checks happen now, not at the first `next()`.
    """
    path = Path(path)
    if format is None:
        if not path.exists():
            raise ParseError(path, "no such file or folder")
        if path.is_file() and path.stat().st_size == 0:
            raise ParseError(path, "empty file")
        format = detect(path)
        if format is None:
            raise ParseError(path, f"unknown log format (known formats: {', '.join(FORMATS)})")
    elif format not in FORMATS:
        raise ValueError(f"unknown log format {format!r}; known formats: {', '.join(FORMATS)}")
    if root is not None and format in READS_ENCLOSING_FOLDERS:
        return FORMATS[format].read(path, root=Path(root))
    return FORMATS[format].read(path)


def find_logs(paths: Iterable[Path],
              on_error: Callable[[Path, str], None] | None = None) -> Iterator[tuple[Path, str | None]]:
    """Each log under `paths` (files and folders, recursively, sorted) with its detected format.

    A folder that is itself a log (an OpenHands completion-log folder) is yielded whole and not
    entered; files no format claims come with None, so callers can report them. Hidden files
    and folders are skipped. Links are followed, but each real folder is entered once, so a
    link back to an enclosing folder (`a -> .`) ends the walk there instead of looping.

    A file or folder that cannot be read (no permission, a broken link) is not yielded: it goes
    to `on_error(path, message)`, and the walk goes on; without `on_error` it raises ParseError.
    """
    seen: set[tuple[int, int]] = set()  # (device, inode) of every folder entered

    def fail(path: Path, message: str) -> None:
        if on_error is None:
            raise ParseError(path, message)
        on_error(path, message)

    def walk(path: Path, top: bool) -> Iterator[tuple[Path, str | None]]:
        try:
            info = path.stat()
        except OSError as error:
            if not top and path.is_symlink():
                fail(path, "cannot read: broken or looping link")
            elif not top:
                fail(path, f"cannot read: {error.strerror or error}")
            else:  # a named path that is not there: the caller's to report
                yield path, None
            return
        if stat.S_ISDIR(info.st_mode):
            if (info.st_dev, info.st_ino) in seen:
                return  # reached again through a link
            seen.add((info.st_dev, info.st_ino))
            detected = detect(path)
            if detected is not None:
                yield path, detected
                return
            try:
                children = sorted(path.iterdir())
            except OSError as error:
                fail(path, f"cannot read folder: {error.strerror or error}")
                return
            for child in children:
                if not child.name.startswith("."):
                    yield from walk(child, top=False)
            return
        try:
            with path.open("rb"):  # detect() reads the head, but sees an unreadable file as empty
                pass
        except OSError as error:
            fail(path, f"cannot read: {error.strerror or error}")
            return
        yield path, detect(path) if info.st_size else None

    for root in paths:
        yield from walk(Path(root), top=True)
