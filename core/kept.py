"""Files specx keeps between runs, read at start without trusting them.

A kept file (the learned forward-cost curve in $SPECX_HOME/cost, a converted tokenizer in
$SPECX_HOME/models) was written by an earlier run, but anything may stand in its place by the
next one: a truncated or hand-edited file, a directory, a FIFO that never opens, a symlink to
/dev/zero that never ends. None of them may stop a start. So a kept file is read only when it is
a regular file of at most `max_bytes` (checked with os.stat before opening, and again on the open
descriptor, which is opened non-blocking: a FIFO swapped in between cannot hang the read), and at
most `max_bytes` + 1 bytes are read whatever its size says. A kept folder that another library
reads (a converted tokenizer) is checked the same way, entry by entry, before it is handed over
(`check_kept_folder`). What cannot be used is set aside under a name that says so (`set_aside`:
learned-<key>.json.unusable-<time>), so the next start does not meet it again and whoever looks
can see what it was.

    try:
        doc = read_kept_json(path)               # None: there is none
    except Unusable as exc:
        aside = set_aside(path)
        say(f"cannot use {path} ({exc}): set aside as {aside}; starting from defaults")
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

MAX_BYTES = 1 << 20  # a kept JSON document (a cost curve is ~2 KB)


class Unusable(ValueError):
    """A kept file that cannot be used; the message says why (one line)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _stat(path: Path | str) -> os.stat_result | None:
    """What stands at `path` (a symlink judged by its target); None: nothing; Unusable: cannot look."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unusable(f"cannot be looked at: {exc.strerror or exc}") from None


def check_kept(path: Path | str, max_bytes: int = MAX_BYTES) -> bool:
    """Whether a kept file is there (False: nothing at `path`, a dangling symlink included);
    Unusable when what is there is not a regular file (a symlink is judged by its target) or is
    larger than `max_bytes`. Reads nothing: for files another library opens (a tokenizer cache)."""
    st = _stat(path)
    if st is None:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise Unusable(f"is {_kind(st.st_mode)}, not a regular file")
    if st.st_size > max_bytes:
        raise Unusable(f"is {st.st_size:,} bytes, more than a kept file may be ({max_bytes:,})")
    return True


def check_kept_folder(folder: Path | str, max_bytes: int = MAX_BYTES, limits: dict[str, int] | None = None) -> bool:
    """Whether a kept folder is there (False: nothing at `folder`); Unusable, naming the entry,
    when it is not a directory or holds anything but regular files of at most `max_bytes` (a
    name in `limits` may be larger: {"tokenizer.json": 64 << 20}). Reads nothing: for a folder
    another library reads (a converted tokenizer or model), checked before it is handed over."""
    st = _stat(folder)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise Unusable(f"is {_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'a file'}, not a folder")
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise Unusable(f"cannot be listed: {exc.strerror or exc}") from None
    for name in names:
        try:
            check_kept(Path(folder) / name, (limits or {}).get(name, max_bytes))
        except Unusable as exc:
            raise Unusable(f"its {name} {exc}") from None
    return True


def read_kept(path: Path | str, max_bytes: int = MAX_BYTES) -> bytes | None:
    """The bytes of a kept file (None: there is none), or Unusable: not a regular file, larger
    than `max_bytes`, unreadable. Never blocks on a FIFO, never reads past `max_bytes` + 1."""
    if not check_kept(path, max_bytes):
        return None
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unusable(f"cannot be opened: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode  # what was opened, which may not be what was looked at
        if not stat.S_ISREG(mode):
            raise Unusable(f"is {_kind(mode)}, not a regular file")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise Unusable(f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise Unusable(f"grew past {max_bytes:,} bytes while read")
    return b"".join(chunks)


def open_kept_lock(path: Path | str) -> Any:
    """A kept lock file opened for flock (a binary file object), made when missing; Unusable when
    something other than a regular file stands there (a FIFO would block a plain open forever, a
    directory cannot be opened for writing). Opened non-blocking and checked again on the
    descriptor, as read_kept does."""
    check_kept(path, max_bytes=1 << 62)  # any size: only its kind matters
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise Unusable(f"cannot be opened: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise Unusable(f"is {_kind(mode)}, not a regular file")
    return os.fdopen(fd, "r+b")


def read_kept_json(path: Path | str, max_bytes: int = MAX_BYTES) -> Any:
    """The JSON document of a kept file (None: there is none), or Unusable: read_kept's reasons,
    not UTF-8, not JSON, nested too deep to read."""
    data = read_kept(path, max_bytes)
    if data is None:
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise Unusable("is not UTF-8 text") from None
    except RecursionError:
        raise Unusable("is JSON nested too deep to read") from None
    except ValueError as exc:
        raise Unusable(f"is not JSON ({exc})") from None


def write_kept_json(path: Path, data: Any) -> None:
    """Write a kept JSON document: beside its place, then renamed into it, so that a reader never
    meets half a file; nothing is left behind when that fails (OSError, or ValueError for data
    that is not JSON)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def set_aside(path: Path | str) -> Path | None:
    """Rename what stands at `path` (a file, a directory, a FIFO; a symlink itself, never its
    target) to `<name>.unusable-<time>` beside it, so that the next start does not meet it;
    the new path, or None when it cannot be renamed (then it stays, and is met again)."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for attempt in range(100):
        target = path.with_name(f"{path.name}.unusable-{stamp}" + (f"-{attempt}" if attempt else ""))
        if os.path.lexists(target):
            continue
        try:
            os.rename(path, target)
        except OSError:
            return None
        return target
    return None
