"""`specx ingest`: agent logs -> store (one transaction per file) -> tokens -> persisted suffix index.

Unchanged files (same content, already stored, tokens present) are skipped without being read or
tokenized, so re-ingesting a folder costs little more than hashing it. A bad record is reported
with its file and line and the rest of the file is kept; a file that cannot be read at all is
reported and the other files go on.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specx.core.suffix_index import SuffixIndex

from .db import IndexState, PackWriter, Store, content_key
from .formats import Call, ParseError, find_logs, read_calls

MAX_DEPTH = 64
REBUILD_FRACTION = 0.1  # more new tokens than this share of the index: rebuild instead of adding


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
        backend = self.get().backend_tokenizer  # Rust: batch encoding on all cores
        return [np.asarray(e.ids, dtype=np.int32) for e in backend.encode_batch(texts, add_special_tokens=False)]


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
           on_file: Callable[[Path], None] = lambda p: None, max_depth: int = MAX_DEPTH) -> IngestReport:
    """Store every call of the logs under `paths` (or of inputs found by `find_inputs`), tokenize
    new outputs, bring the index up to date."""
    inputs = paths if isinstance(paths, Inputs) else find_inputs(paths, fmt)
    report = inputs.report
    known_tokenizer = store.tokenizer_id(name=tokenizer.name)
    for path, detected, root in inputs.logs:
        on_file(path)
        report.files += 1
        try:
            _ingest_file(store, path, detected, root, tokenizer, known_tokenizer, report)
        except ParseError as exc:
            report.error(exc.path, exc.message, exc.line)
        except (OSError, UnicodeError) as exc:
            report.error(path, f"cannot read: {exc}")
    tokenizer_id = store.tokenizer_id(tokenizer.fingerprint) if tokenizer.fingerprint else known_tokenizer
    if tokenizer_id is not None:
        report.index = update_index(store, tokenizer_id, max_depth)
    return report


def _ingest_file(store: Store, path: Path, fmt: str, root: Path, tokenizer: Tokenizer,
                 known_tokenizer: int | None, report: IngestReport) -> None:
    sha, size = file_sha256(path)
    source_key = content_key(fmt, sha)
    previous = store.source(source_key)
    if previous is not None and previous["error"] is None and known_tokenizer is not None \
            and not _calls_missing_tokens(store, previous["id"], known_tokenizer):
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
            _upsert_source(store, source_key, path, fmt, sha, size, 0, 1, exc.message)
        raise
    report.calls += len(calls)
    report.by_format[fmt] = report.by_format.get(fmt, 0) + len(calls)
    tok = tokenizer.get()  # outputs may need tokens: load it now (fast once cached)
    with store.db.atomic():  # one transaction per file: a killed ingest leaves the file all in or all out
        tokenizer_id = store.add_tokenizer(tokenizer.fingerprint, tokenizer.name, len(tok))
        source_id = _upsert_source(store, source_key, path, fmt, sha, size, len(calls), num_errors, None)
        # Sessions are told apart by the file they come from (by its real path: the same file
        # named another way is the same session), so the same instance id in two submissions'
        # folders stays two sessions.
        call_ids, num_new = _insert_calls(store, source_id, path, fmt, calls, scope=str(path.resolve()),
                                          legacy_scope=path.name)
        missing = set(_ids_without_tokens(store, call_ids, tokenizer_id))
        todo = [(cid, call.output_text) for cid, call in zip(call_ids, calls) if cid in missing]
        todo = list(dict(todo).items())  # a call repeated within the file is tokenized once
        if todo:
            encoded = tokenizer.encode([text for _, text in todo])
            insert_tokens(store, tokenizer_id, [(cid, tokens) for (cid, _), tokens in zip(todo, encoded)])
            report.new_tokens += int(sum(len(t) for t in encoded))
    report.new_calls += num_new
    report.duplicate_calls += len(calls) - num_new


def insert_tokens(store: Store, tokenizer_id: int, rows: list[tuple[int, Any]]) -> None:
    """Token rows (call id, token ids) for calls that have none yet for this tokenizer, in one pack."""
    packs = PackWriter(store, "tokens")
    values = []
    for cid, tokens in rows:
        pack, offset = packs.add(np.asarray(tokens, dtype="<i4").tobytes())
        values.append((cid, tokenizer_id, len(tokens), pack, offset))
    packs.flush()
    store.db.conn.executemany("INSERT INTO tokens (call_id, tokenizer_id, num_tokens, pack_id, pack_offset)"
                              " VALUES (?,?,?,?,?)", values)


def _upsert_source(store: Store, key: bytes, path: Path, fmt: str, sha: str, size: int, num_calls: int,
                   num_errors: int, error: str | None) -> int:
    store.db.execute(
        "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error)"
        " VALUES (?, ?, ?, ?, ?, datetime('now'), ?, ?, ?) ON CONFLICT(key) DO UPDATE SET path = excluded.path,"
        " ingested_at = excluded.ingested_at, num_calls = excluded.num_calls, num_errors = excluded.num_errors,"
        " error = excluded.error", [key, str(path), fmt, sha, size, num_calls, num_errors, error])
    return store.db.execute("SELECT id FROM sources WHERE key = ?", [key]).fetchone()[0]


def _existing_id(store: Store, table: str, key: bytes) -> int | None:
    row = store.db.execute(f"SELECT id FROM {table} WHERE key = ?", [key]).fetchone()
    return None if row is None else row[0]


def _insert_calls(store: Store, source_id: int, path: Path, fmt: str, calls: list[Call], scope: str | None = None,
                  legacy_scope: str | None = None) -> tuple[list[int], int]:
    """Insert sessions, messages and calls (each only if new); returns the calls' ids and how many were new.

    A session's key is its format, `scope` (default: the file's name), session id and model. A call
    stored under `legacy_scope` instead counts as stored too: stores written before ingest scoped
    sessions by the file's path keyed them by its name, and re-reading a file into one (for another
    tokenizer, or grown) must not add its calls again."""
    scope = path.name if scope is None else scope
    call_ids, num_new = [], 0
    sessions: dict[bytes, int] = {}
    messages: dict[bytes, int] = {}
    message_pack, prompt_pack, output_pack = (PackWriter(store, k) for k in ("message", "prompt", "output"))
    for call in calls:
        skey = content_key(fmt, scope, call.session_id, call.model)
        if call.prompt_messages is not None:
            prompt = call.prompt_messages
        elif call.prompt_text is not None:
            prompt = [{"role": "prompt_text", "content": call.prompt_text}]  # a plain-text prompt, whole
        else:
            prompt = None
        message_ids, message_keys, prompt_bytes = [], [], 0
        for message in prompt or []:
            raw = json.dumps(message, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str).encode(
                "utf-8", "surrogatepass")
            mkey = hashlib.sha256(raw).digest()[:16]
            if mkey not in messages:
                messages[mkey] = _existing_id(store, "messages", mkey) or store.db.execute(
                    "INSERT INTO messages (key, pack_id, pack_offset, raw_bytes) VALUES (?, ?, ?, ?)",
                    [mkey, *message_pack.add(raw), len(raw)]).lastrowid
            message_ids.append(messages[mkey])
            message_keys.append(mkey.hex())
            prompt_bytes += len(raw)
        content = (call.position, call.agent, call.model, None if prompt is None else message_keys, call.output_text)
        ckey = content_key(skey.hex(), *content)
        cid = _existing_id(store, "calls", ckey)
        if cid is None and legacy_scope is not None:
            old_skey = content_key(fmt, legacy_scope, call.session_id, call.model)
            cid = _existing_id(store, "calls", content_key(old_skey.hex(), *content))
        if cid is None:
            if skey not in sessions:
                sessions[skey] = _existing_id(store, "sessions", skey) or store.db.execute(
                    "INSERT INTO sessions (key, source_id, session_key, format, model) VALUES (?, ?, ?, ?, ?)",
                    [skey, source_id, str(call.session_id), fmt, call.model]).lastrowid
            output = call.output_text.encode("utf-8", "surrogatepass")
            ppack, poffset = prompt_pack.add(np.asarray(message_ids, dtype="<i4").tobytes()) if prompt is not None \
                else (None, None)
            cid = store.db.execute(
                "INSERT INTO calls (key, session_id, position, agent, model, prompt_pack, prompt_offset, num_messages,"
                " prompt_bytes, output_pack, output_offset, output_bytes, started_at, ended_at, line, meta)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [ckey, sessions[skey], call.position, call.agent, call.model, ppack, poffset, len(message_ids),
                 prompt_bytes, *output_pack.add(output), len(output), call.started_at, call.ended_at, call.line,
                 json.dumps(call.meta, ensure_ascii=False, default=str) if call.meta else None]).lastrowid
            num_new += 1
        call_ids.append(cid)
    for writer in (message_pack, prompt_pack, output_pack):
        writer.flush()
    return call_ids, num_new


def _chunked(ids: list[int], size: int = 900) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def _ids_without_tokens(store: Store, call_ids: list[int], tokenizer_id: int) -> list[int]:
    have: set[int] = set()
    for part in _chunked(call_ids):
        marks = ",".join("?" * len(part))
        have.update(r[0] for r in store.db.execute(
            f"SELECT call_id FROM tokens WHERE tokenizer_id = ? AND call_id IN ({marks})", [tokenizer_id, *part]))
    return sorted(set(call_ids) - have)


def _calls_missing_tokens(store: Store, source_id: int, tokenizer_id: int) -> bool:
    row = store.db.execute(
        "SELECT 1 FROM calls c JOIN sessions s ON s.id = c.session_id WHERE s.source_id = ? AND NOT EXISTS"
        " (SELECT 1 FROM tokens t WHERE t.call_id = c.id AND t.tokenizer_id = ?) LIMIT 1",
        [source_id, tokenizer_id]).fetchone()
    return row is not None


def update_index(store: Store, tokenizer_id: int, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Bring the persisted index of a tokenizer up to date: nothing, online adds, or a rebuild."""
    t0 = time.perf_counter()
    count, last = store.token_rows(tokenizer_id)
    state = store.index_state(tokenizer_id)
    if state is not None and (state.num_calls, state.last_token_rowid, state.max_depth) == (count, last, max_depth):
        return {"action": "unchanged", "calls": count, "tokens": state.num_tokens, "seconds": time.perf_counter() - t0}
    index = None
    action = "built"
    if state is not None and state.max_depth == max_depth \
            and store.token_rows(tokenizer_id, state.last_token_rowid)[0] == state.num_calls:
        # Only rows were added since: add them online unless they are many.
        new = [t for _, t in store.iter_tokens(tokenizer_id, after_rowid=state.last_token_rowid)]
        if sum(len(t) for t in new) <= REBUILD_FRACTION * max(state.num_tokens, 1):
            index = _load_persisted(store, state)
            for tokens in new:
                index.add(tokens)
            action = "updated"
    if index is None:
        index = SuffixIndex.build([t for _, t in store.iter_tokens(tokenizer_id)], max_depth=max_depth)
    store.save_index(IndexState(tokenizer_id, max_depth, count, last, index.num_tokens),
                     index.to_bytes(include_text=False))
    return {"action": action, "calls": count, "tokens": index.num_tokens, "seconds": time.perf_counter() - t0}


def _load_persisted(store: Store, state: IndexState) -> SuffixIndex:
    """The saved index, its text reassembled from the token rows it covers (no re-sorting)."""
    parts = []
    for _, tokens in store.iter_tokens(state.tokenizer_id, upto_rowid=state.last_token_rowid):
        parts.append(tokens)
        parts.append(np.array([-1], dtype=np.int32))  # SEP after each sequence
    text = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    return SuffixIndex.from_bytes(store.index_bytes(state.tokenizer_id), text=text)


def load_index(store: Store, tokenizer_id: int, max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """The global index of a tokenizer's stored outputs, brought up to date first if stale."""
    update_index(store, tokenizer_id, max_depth)
    state = store.index_state(tokenizer_id)
    return _load_persisted(store, state)  # type: ignore[arg-type]


def index_for(store: Store, fingerprint: str, max_depth: int = MAX_DEPTH) -> SuffixIndex:
    """load_index for the tokenizer with this fingerprint; an empty index when the store has no
    tokens for it (what `specx generate` and `specx serve` draft from)."""
    tokenizer_id = store.tokenizer_id(fingerprint)
    return load_index(store, tokenizer_id, max_depth) if tokenizer_id is not None else SuffixIndex(max_depth)
