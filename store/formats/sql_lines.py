"""Plain prediction files with one SQL statement per line (DAIL-SQL `*.sql.txt` and the like).

One Call per non-empty line: output = the line without surrounding whitespace, session id = the
file name, position = the 0-based line index (so line i still answers question i of the dataset
when blank lines occur), no prompt (it is not stored).

`sniff` is strict so that it does not claim arbitrary text: the head must be text, not JSON,
and at least 90% of its non-blank lines (and at least one) must start with an SQL keyword in
all capitals or all lower case (`SELECT ...`, `select ...`; prose writes "Select").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from ._call import Call, ParseError
from ._source import HEAD_BYTES, head_lines, head_text, iter_text_lines

_KEYWORDS = "select|with|insert|update|delete|create|drop|alter|replace|values|explain|pragma"
_SQL_LINE = re.compile(rf"\(*\s*(?:{_KEYWORDS}|{_KEYWORDS.upper()})(?:\s|\(|\*|$)")
_MIN_SQL_SHARE = 0.9


def sniff(path: Path, head: bytes) -> bool:
    """Text whose non-blank lines are (nearly) all single SQL statements."""
    text = head_text(head)
    if text is None or text.lstrip()[:1] in ("{", "["):
        return False
    lines = head_lines(text, whole=len(head) < HEAD_BYTES)
    if not lines:
        return False
    num_sql = sum(1 for line in lines if _SQL_LINE.match(line.strip()))
    return num_sql >= _MIN_SQL_SHARE * len(lines)


def read(path: Path) -> Iterator[Call | ParseError]:
    """One Call per non-empty line; a line that is not UTF-8 is reported and skipped."""
    num_ok = 0
    num_bad = 0
    for item in iter_text_lines(path):
        if isinstance(item, ParseError):
            num_bad += 1
            yield item
            continue
        number, line = item
        if not line.strip():
            continue
        num_ok += 1
        yield Call(session_id=path.name, position=number - 1, output_text=line.strip(), line=number)
    if num_ok == 0:
        raise ParseError(path, "empty file" if num_bad == 0 else f"no readable line ({num_bad} not UTF-8)")
