"""Reading helpers shared by the format modules: file heads, whole JSON documents, JSON Lines.

Every reader turns "this file cannot be read at all" into a `ParseError` naming the file, and a
bad line of a JSON Lines file into a yielded `ParseError`, so one broken record never hides the
rest of a log.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._call import ParseError

HEAD_BYTES = 64 * 1024

_BLANK = re.compile(rb"\s*")


def read_head(path: Path, size: int = HEAD_BYTES) -> bytes:
    """The first `size` bytes of a file (b"" for a folder or an unreadable file)."""
    if not path.is_file():
        return b""
    try:
        with path.open("rb") as f:
            return f.read(size)
    except OSError:
        return b""


def head_text(head: bytes) -> str | None:
    """Decode a head as UTF-8 text, or None when it is not text (NUL bytes, mostly undecodable).

    A few bad bytes are replaced rather than rejected: a head cut at 64 KiB may end inside a
    character, and one bad line must not hide a whole log from detection (its reader reports it).
    """
    if b"\x00" in head:
        return None
    text = head.decode("utf-8", errors="replace")
    if text.count("\ufffd") * 100 > len(text):
        return None
    return text.removeprefix("\ufeff")


def head_lines(text: str, whole: bool) -> list[str]:
    """Non-blank lines of a head; the last line is dropped when the head is only part of the file."""
    lines = text.split("\n")
    if not whole:
        lines = lines[:-1]
    return [line for line in lines if line.strip()]


def head_records(head: bytes, limit: int = 20) -> list[Any]:
    """Up to `limit` JSON values parsed from the complete lines of a head; bad lines are skipped."""
    text = head_text(head)
    if text is None:
        return []
    records = []
    for line in head_lines(text, whole=len(head) < HEAD_BYTES)[:limit]:
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):
            continue
    return records


def load_json(path: Path) -> Any:
    """Parse a whole JSON document, raising ParseError for an empty, non-UTF-8, truncated or invalid file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ParseError(path, f"cannot read: {error.strerror or error}") from None
    if _BLANK.fullmatch(data):
        raise ParseError(path, "empty file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ParseError(path, f"not UTF-8 text (bad byte at offset {error.start})") from None
    del data  # the decoded text is enough; keep peak memory near 2x the file
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        if error.pos >= len(text.rstrip()):
            raise ParseError(path, "truncated JSON document", line=error.lineno) from None
        raise ParseError(path, f"invalid JSON: {error.msg}", line=error.lineno) from None
    except RecursionError:
        raise ParseError(path, "JSON nested too deep to read") from None


def iter_text_lines(path: Path, parse: Callable[[str], Any] | None = None) -> Iterator[tuple[int, Any] | ParseError]:
    """Yield `(line_number, text)` for each non-blank line, or a ParseError for a bad line.

    With `parse`, yield `(line_number, parse(text))`; a ValueError from it becomes a ParseError
    with its message. Parsing happens here, not in the caller, so that the text is dropped before
    the value leaves: a suspended generator keeps its locals, and a single line may be hundreds
    of MB.
    """
    try:
        f = path.open("rb")
    except OSError as error:
        raise ParseError(path, f"cannot read: {error.strerror or error}") from None
    with f:
        for number, raw in enumerate(f, start=1):
            if _BLANK.fullmatch(raw):
                continue
            try:
                value = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                yield ParseError(path, f"not UTF-8 text (bad byte at column {error.start + 1})", line=number)
                continue
            del raw  # never hold the bytes and the text of a huge line together
            if parse is not None:
                try:
                    value = parse(value)  # rebinding drops the text
                except ValueError as error:
                    yield ParseError(path, str(error), line=number)
                    continue
            yield number, value
            del value


def _json_line(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid JSON: {error.msg} (column {error.colno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None


def iter_json_lines(path: Path) -> Iterator[tuple[int, Any] | ParseError]:
    """Yield `(line_number, value)` for each non-blank line, or a ParseError for a bad line.

    Raises ParseError for an empty file, or at the end when not a single line could be parsed
    (by then the per-line errors have been yielded).
    """
    num_ok = 0
    num_bad = 0
    for item in iter_text_lines(path, parse=_json_line):
        if isinstance(item, ParseError):
            num_bad += 1
        else:
            num_ok += 1
        yield item
        del item
    if num_ok == 0 and num_bad == 0:
        raise ParseError(path, "empty file")
    if num_ok == 0:
        raise ParseError(path, f"no readable JSON line ({num_bad} malformed)")


def json_or_repr(text: str) -> Any:
    """Parse a value stored as JSON text or as a Python repr string (some OpenHands logs do this).

    `ast.literal_eval` only builds literals (str, numbers, dicts, lists, True/None...), so an
    untrusted log cannot run code through it. Raises ValueError when neither parses.
    """
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as error:
        raise ValueError(f"neither JSON nor a Python literal ({type(error).__name__})") from None
