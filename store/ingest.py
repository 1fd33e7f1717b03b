"""`specx ingest`: agent logs -> store (one transaction per file) -> tokens -> persisted suffix index.

Unchanged files (same content, already stored, tokens present) are skipped without being read or
tokenized, so re-ingesting a folder costs little more than hashing it. A bad record is reported
with its file and line and the rest of the file is kept; a file that cannot be read at all is
reported and the other files go on.
"""

from __future__ import annotations

import errno
import hashlib
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .calls import calls_missing_tokens, ids_without_tokens, insert_calls, insert_tokens
from .db import Store
from .formats import Call, ParseError, find_logs, read_calls
from .index import MAX_DEPTH, update_index
from .tenants import DEFAULT, check_tenant, session_scope, source_key

MAX_OUTPUT_CHARS = 1 << 20  # a call's output longer than this is refused (named), not tokenized: ~150 bytes a
                            # character in the tokenizer would take gigabytes (seen: 6.4 GB for 43 MB)


@dataclass
class IngestReport:
    files: int = 0
    skipped_files: int = 0  # unchanged since a previous ingest
    calls: int = 0
    new_calls: int = 0
    new_tokens: int = 0
    duplicate_calls: int = 0  # calls read that were already stored (an earlier ingest, or repeated in a log)
    by_format: dict[str, int] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    unrecognized: list[str] = field(default_factory=list)  # files met in a folder that no format claims
    index: dict[str, Any] | None = None

    def error(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.errors.append({"path": str(path), "line": line, "message": message})

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "skipped_files": self.skipped_files, "calls": self.calls,
                "new_calls": self.new_calls, "duplicate_calls": self.duplicate_calls, "new_tokens": self.new_tokens,
                "by_format": self.by_format,
                "errors": self.errors, "unrecognized": self.unrecognized, "index": self.index}


class Tokenizer:
    """A tokenizer loaded only when something needs tokenizing; knows its fingerprint."""

    def __init__(self, name: str, load: Callable[[], Any], fingerprint: Callable[[Any], str]) -> None:
        self.name = name
        self._load = load
        self._fingerprint_of = fingerprint
        self._tok: Any = None
        self.fingerprint: str | None = None

    def get(self) -> Any:
        if self._tok is None:
            self._tok = self._load()
            self.fingerprint = self._fingerprint_of(self._tok)
        return self._tok

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return encode_texts(self.get(), texts)


def encode_texts(tok: Any, texts: list[str]) -> list[np.ndarray]:
    """The token rows of `texts` as the store keeps outputs: no special tokens, lone surrogates
    replaced (`tokenizable`), batch-encoded by the Rust backend on all cores (ingest and corpora)."""
    texts = [text if text.isascii() else tokenizable(text) for text in texts]
    return [np.asarray(e.ids, dtype=np.int32)
            for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def tokenizable(text: str) -> str:
    """`text` with lone surrogates (a JSON escape such as \\ud800 decodes to one, and the tokenizer
    refuses them) replaced by U+FFFD, as a UTF-8 decoder replaces a bad byte; the stored text
    keeps them.

    >>> tokenizable("a" + chr(0xD800) + "b") == "a" + "\ufffd" * 3 + "b"
    True
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def file_sha256(path: Path) -> tuple[str, int]:
    """Content hash and size of a file, or of a folder log (its files' names and hashes)."""
    if path.is_dir():
        h = hashlib.sha256()
        size = 0
        for child in sorted(path.rglob("*")):
            if child.is_file():
                sub, n = file_sha256(child)
                h.update(f"{child.relative_to(path)}\0{sub}\n".encode())
                size += n
        return h.hexdigest(), size
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest(), path.stat().st_size


@dataclass
class Inputs:
    """What an ingest will read, found before the store is opened (a command whose inputs are all
    missing or unreadable fails without creating a store)."""

    logs: list[tuple[Path, str, Path]]  # (log, format, the path named by the user that led to it)
    report: IngestReport  # errors and unrecognized files met while looking


def find_inputs(paths: list[Path], fmt: str | None = None) -> Inputs:
    """The logs under `paths` with their formats; missing, empty, unreadable and (when named
    explicitly) unrecognized files are errors in the report, files no format claims inside a
    folder are listed as unrecognized."""
    report = IngestReport()
    logs = []
    for root in paths:
        root = Path(root)
        if not root.exists():
            report.error(root, "no such file or folder")
            continue
        for path, detected in find_logs([root], on_error=lambda p, m: report.error(p, m)):
            if path == root and root.is_file() and root.stat().st_size == 0:
                report.error(path, "empty file")
            elif fmt is not None:
                logs.append((path, fmt, root))
            elif detected is not None:
                logs.append((path, detected, root))
            elif path == root:
                report.error(path, "unknown log format (see `specx ingest --help` for the formats read)")
            else:
                report.unrecognized.append(str(path))  # a README or data file beside the logs
    return Inputs(logs, report)


def ingest(store: Store, paths: list[Path] | Inputs, tokenizer: Tokenizer, fmt: str | None = None,
           on_file: Callable[[Path], None] = lambda p: None, max_depth: int = MAX_DEPTH,
           tenant: str = DEFAULT) -> IngestReport:
    """Store every call of the logs under `paths` (or of inputs found by `find_inputs`) in
    `tenant`'s history (store/tenants.py: the same file for two tenants is two histories), tokenize
    new outputs, bring the index up to date."""
    if tenant != DEFAULT:
        check_tenant(tenant)
    inputs = paths if isinstance(paths, Inputs) else find_inputs(paths, fmt)
    report = inputs.report
    known_tokenizer = store.tokenizer_id(name=tokenizer.name)
    for i, (path, detected, root) in enumerate(inputs.logs):
        on_file(path)
        report.files += 1
        counts = (report.calls, report.new_calls, report.duplicate_calls, report.new_tokens, dict(report.by_format))
        try:
            _ingest_file(store, path, detected, root, tokenizer, known_tokenizer, report, tenant)
        except ParseError as exc:
            report.error(exc.path, exc.message, exc.line)
        except (OSError, UnicodeError, sqlite3.OperationalError) as exc:
            if not disk_full(exc):
                if isinstance(exc, sqlite3.OperationalError):
                    raise
                report.error(path, f"cannot read: {exc}")
                continue
            # Each file is one transaction: this one was rolled back, the store is as it was before it.
            report.calls, report.new_calls, report.duplicate_calls, report.new_tokens, report.by_format = counts
            report.error(store.path, f"no space left on device writing {store.path}: {path} and the "
                                     f"{len(inputs.logs) - i - 1} files after it were not stored (the store is "
                                     f"intact: free some space and ingest again)")
            return report
        except RecursionError:
            report.error(path, "nested too deep to read")
    tokenizer_id = store.tokenizer_id(tokenizer.fingerprint) if tokenizer.fingerprint else known_tokenizer
    if tokenizer_id is not None:
        try:
            report.index = update_index(store, tokenizer_id, max_depth)
        except (OSError, sqlite3.OperationalError) as exc:
            if not disk_full(exc):
                raise
            report.error(store.path, f"no space left on device writing {store.path}: the calls are stored, the "
                                     f"index was not saved (the next command that reads the store builds it)")
    return report


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` says the disk is full (SQLite's SQLITE_FULL, or ENOSPC from a file write)."""
    if isinstance(exc, sqlite3.OperationalError):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _ingest_file(store: Store, path: Path, fmt: str, root: Path, tokenizer: Tokenizer,
                 known_tokenizer: int | None, report: IngestReport, tenant: str = DEFAULT) -> None:
    sha, size = file_sha256(path)
    key = source_key(fmt, sha, tenant)
    previous = store.source(key)
    if previous is not None and previous["error"] is None and known_tokenizer is not None \
            and not calls_missing_tokens(store, previous["id"], known_tokenizer):
        report.skipped_files += 1
        report.calls += previous["num_calls"]
        report.by_format[fmt] = report.by_format.get(fmt, 0) + previous["num_calls"]
        return
    calls: list[Call] = []
    num_errors = 0
    try:
        for item in read_calls(path, fmt, root=root if root.is_dir() else path.parent):
            if isinstance(item, ParseError):
                report.error(item.path, item.message, item.line)
                num_errors += 1
            else:
                calls.append(item)
    except ParseError as exc:
        with store.db.atomic():
            _upsert_source(store, key, path, fmt, sha, size, 0, 1, exc.message, tenant)
        raise
    kept = []
    for call in calls:  # a record past the bound would take gigabytes in the tokenizer: refused, named
        if len(call.output_text) > MAX_OUTPUT_CHARS:
            report.error(path, f"a call's output has {len(call.output_text):,} characters (at most "
                               f"{MAX_OUTPUT_CHARS:,} are stored): not stored", call.line)
            num_errors += 1
        else:
            kept.append(call)
    calls = kept
    report.calls += len(calls)
    report.by_format[fmt] = report.by_format.get(fmt, 0) + len(calls)
    tok = tokenizer.get()  # outputs may need tokens: load it now (fast once cached)
    with store.db.atomic():  # one transaction per file: a killed ingest leaves the file all in or all out
        tokenizer_id = store.add_tokenizer(tokenizer.fingerprint, tokenizer.name, len(tok))
        source_id = _upsert_source(store, key, path, fmt, sha, size, len(calls), num_errors, None, tenant)
        # Sessions are told apart by the file they come from (by its real path: the same file
        # named another way is the same session), so the same instance id in two submissions'
        # folders stays two sessions; and by the tenant, so two tenants' sessions stay apart.
        call_ids, num_new = insert_calls(store, source_id, path, fmt, calls,
                                          scope=session_scope(str(path.resolve()), tenant),
                                          legacy_scope=path.name if tenant == DEFAULT else None)
        missing = set(ids_without_tokens(store, call_ids, tokenizer_id))
        todo = [(cid, call.output_text) for cid, call in zip(call_ids, calls) if cid in missing]
        todo = list(dict(todo).items())  # a call repeated within the file is tokenized once
        if todo:
            encoded = tokenizer.encode([text for _, text in todo])
            insert_tokens(store, tokenizer_id, [(cid, tokens) for (cid, _), tokens in zip(todo, encoded)])
            report.new_tokens += int(sum(len(t) for t in encoded))
    report.new_calls += num_new
    report.duplicate_calls += len(calls) - num_new


def _upsert_source(store: Store, key: bytes, path: Path, fmt: str, sha: str, size: int, num_calls: int,
                   num_errors: int, error: str | None, tenant: str = DEFAULT) -> int:
    store.db.execute(  # the key carries the tenant: a conflict is the same tenant's source
        "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error, tenant)"
        " VALUES (?, ?, ?, ?, ?, datetime('now'), ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET path = excluded.path,"
        " ingested_at = excluded.ingested_at, num_calls = excluded.num_calls, num_errors = excluded.num_errors,"
        " error = excluded.error", [key, str(path), fmt, sha, size, num_calls, num_errors, error, tenant])
    return store.db.execute("SELECT id FROM sources WHERE key = ?", [key]).fetchone()[0]


