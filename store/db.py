"""The SQLite store: sources, sessions, calls, content-addressed prompt messages, token arrays per
tokenizer, and the persisted suffix index.

Rows carry content-hash keys, so ingesting the same data twice adds nothing. A call's prompt is a
list of message ids: agents resend the whole conversation on every call, and system prompts and
demonstrations repeat across sessions, so each distinct message is stored once.

Payloads (messages, prompts, outputs, token arrays) live in packs: one zstd frame holds the new
payloads of one log file (up to PACK_BYTES raw), and a row points at its bytes by pack, offset and
length. Compressing a file's payloads together rather than one by one makes the store several
times smaller (agent logs repeat across calls); sequential reads decompress each pack once (LRU).
WAL mode; each log file is written in one transaction, so a killed ingest leaves every file
either fully stored or not at all.

Opening a store checks it before anything is written: a store from a newer specx (a schema
version or migration this code does not know) and a corrupt one (SQLite's quick_check, ~0.4 ms
per MB cached, ~2 from disk) are refused with a StoreError, so no command writes into either.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from sqlite_utils import Database

from . import codec
from .schema import MIGRATIONS, health_problems, migrations, schema_problem
INDEX_CHUNK_BYTES = 64 * 1024 * 1024  # SQLite blobs stay well under its 1 GB limit
PACK_BYTES = 4 * 1024 * 1024


class StoreError(ValueError):
    """The store file cannot be used (not a specx store, corrupt, newer schema)."""


def content_key(*parts: Any) -> bytes:
    """A 128-bit content hash of JSON-encodable parts."""
    data = json.dumps(parts, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).digest()[:16]


@dataclass(frozen=True)
class IndexState:
    tokenizer_id: int
    max_depth: int
    num_calls: int
    last_token_rowid: int
    num_tokens: int


@contextlib.contextmanager
def _setup_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock while a writer sets the store up (journal mode, migrations):
    SQLite's own locks cannot order that (seen: "table sources already exists" and "database is
    locked" from two ingests into one new store). A lock file, not the store itself: closing any
    descriptor of the store would drop SQLite's POSIX locks on it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: SQLite's busy timeout only
        yield
        return
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def writable(path: Path) -> bool:
    """Whether a store at `path` can be written here: the file (when there is one) and its folder,
    where SQLite makes its -wal and -shm files (False on a read-only filesystem or folder)."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.exists():
        return True  # made by the writer, or its error says why not
    return os.access(folder, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A read-only connection. A WAL store needs its -shm file to be read, and in a read-only
    folder or filesystem none can be made: then the file is opened immutable (SQLite takes no
    lock and makes no file; what its -wal held past the last checkpoint is not seen)."""
    uri = path.resolve().as_uri()
    conn = sqlite3.connect(uri + "?mode=ro", uri=True)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError:
        if writable(path):
            return conn  # not the folder's fault: the checks below name what is wrong
        conn.close()
    return sqlite3.connect(uri + "?immutable=1", uri=True)


class Store:
    """A specx store file. Use as a context manager, or call close().

    A missing file is created, unless `readonly`: that opens an existing specx store for reading
    only (no migration, no write, not even of its journal mode). `readonly="auto"`, for commands
    that only read: read-write where the store can be written (it is migrated), else read-only
    (a store on a read-only filesystem or in a folder this user cannot write). A writer meets a
    store it cannot write with a StoreError saying so; `self.readonly` says how it was opened.
    """

    def __init__(self, path: Path, *, readonly: bool | str = False) -> None:
        self.path = Path(path)
        exists = self.path.exists()
        if readonly == "auto":
            readonly = exists and not writable(self.path)
        self.readonly = bool(readonly)
        if not exists and readonly:
            raise StoreError(f"{self.path}: no such store (run `specx ingest` first)")
        if not readonly and not writable(self.path):
            raise StoreError(f"{self.path}: read-only here (a read-only filesystem, or a folder or file this user "
                             "cannot write): this command writes into the store; the commands that only read it "
                             "(ls, check, entropy, replay, generate, serve) open it read-only")
        if not exists:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = connect_readonly(self.path) if readonly else sqlite3.connect(self.path)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the store ({exc})") from None
        self.db = Database(conn)
        try:
            self.db.execute("PRAGMA busy_timeout=10000")
            # Checked before anything is written: not even the journal mode goes into a store
            # that is newer than this code or damaged.
            problem = schema_problem(conn)
            if problem:
                raise StoreError(f"{self.path}: written by a newer specx ({problem}); upgrade specx to use it"
                                 " (nothing was written)")
            damage = health_problems(conn)
            if damage:
                more = f" and {len(damage) - 1}{'+' if len(damage) >= 100 else ''} more problems" \
                    if len(damage) > 1 else ""
                raise StoreError(f"{self.path}: the store is corrupt ({damage[0]}{more}); nothing was written"
                                 " (`specx check` lists what is wrong)")
            if readonly and self.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'sources'"
                                            ).fetchone() is None:
                raise StoreError(f"{self.path}: not a specx store (it holds no sources table)")
            if not readonly:
                with _setup_lock(self.path):  # two processes creating one store must not both migrate it
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=NORMAL")
                    migrations.apply(self.db)
                    if self.db.execute("PRAGMA user_version").fetchone()[0] != len(MIGRATIONS):
                        self.db.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"{self.path}: not a usable specx store ({exc})") from None
        except StoreError:
            conn.close()
            raise
        # Packs never change once written: keep the recently read ones decompressed.
        self._pack = functools.lru_cache(maxsize=32)(self._load_pack)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    # ----------------------------------------------------------------- reading

    def source(self, key: bytes) -> dict[str, Any] | None:
        rows = list(self.db.query("SELECT * FROM sources WHERE key = ?", [key]))
        return rows[0] if rows else None

    def tokenizer_id(self, fingerprint: str | None = None, name: str | None = None) -> int | None:
        """A tokenizer's id by fingerprint, or the one last recorded under a name (no need to load it)."""
        if fingerprint is not None:
            row = self.db.execute("SELECT id FROM tokenizers WHERE fingerprint = ?", [fingerprint]).fetchone()
        else:
            row = self.db.execute("SELECT id FROM tokenizers WHERE name = ? ORDER BY id DESC LIMIT 1",
                                  [name]).fetchone()
        return int(row[0]) if row else None

    def add_tokenizer(self, fingerprint: str, name: str, vocab_size: int) -> int:
        """Id of a tokenizer, recorded if new (call inside a transaction)."""
        self.db.execute("INSERT INTO tokenizers (fingerprint, name, vocab_size, created_at)"
                        " VALUES (?, ?, ?, datetime('now')) ON CONFLICT(fingerprint) DO NOTHING",
                        [fingerprint, name, vocab_size])
        return self.tokenizer_id(fingerprint)  # type: ignore[return-value]

    def read(self, pack_id: int, offset: int, length: int) -> bytes:
        """Bytes of one payload."""
        return self._pack(pack_id)[offset : offset + length]

    def _load_pack(self, pack_id: int) -> bytes:
        row = self.db.execute("SELECT data FROM packs WHERE id = ?", [pack_id]).fetchone()
        if row is None:
            raise StoreError(f"{self.path}: missing pack {pack_id} (corrupt store)")
        try:
            return codec.decompress(row[0])
        except codec.BlobError as exc:
            raise StoreError(f"{self.path}: pack {pack_id} is {exc} (`specx check` lists what it holds)") from None

    def call_output(self, call_id: int) -> str:
        pack, offset, length = self.db.execute(
            "SELECT output_pack, output_offset, output_bytes FROM calls WHERE id = ?", [call_id]).fetchone()
        return self.read(pack, offset, length).decode("utf-8", "surrogatepass")

    def call_prompt(self, call_id: int) -> list[dict[str, Any]] | None:
        """A call's prompt messages (a plain-text prompt is one message with role "prompt_text")."""
        ids = self.call_prompt_ids(call_id)
        return None if ids is None else [self.message(mid) for mid in ids]

    def call_prompt_ids(self, call_id: int) -> list[int] | None:
        """The ids of a call's prompt messages (shared by every call that sent the same message)."""
        pack, offset, count = self.db.execute(
            "SELECT prompt_pack, prompt_offset, num_messages FROM calls WHERE id = ?", [call_id]).fetchone()
        if pack is None:
            return None
        return np.frombuffer(self.read(pack, offset, 4 * count), dtype="<i4").tolist()

    def message(self, message_id: int) -> dict[str, Any]:
        pack, offset, length = self.db.execute(
            "SELECT pack_id, pack_offset, raw_bytes FROM messages WHERE id = ?", [message_id]).fetchone()
        return json.loads(self.read(pack, offset, length).decode("utf-8", "surrogatepass"))

    def call_tokens(self, call_id: int, tokenizer_id: int) -> np.ndarray | None:
        row = self.db.execute("SELECT pack_id, pack_offset, num_tokens FROM tokens WHERE call_id = ?"
                              " AND tokenizer_id = ?", [call_id, tokenizer_id]).fetchone()
        if row is None:
            return None
        return np.frombuffer(self.read(row[0], row[1], 4 * row[2]), dtype="<i4").astype(np.int32)

    def iter_tokens(self, tokenizer_id: int, after_rowid: int = 0,
                    upto_rowid: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        """(rowid, output tokens) of every call for a tokenizer, in ingest order."""
        upto = upto_rowid if upto_rowid is not None else 2**62
        rows = self.db.execute(
            "SELECT rowid, pack_id, pack_offset, num_tokens FROM tokens WHERE tokenizer_id = ? AND rowid > ?"
            " AND rowid <= ? ORDER BY rowid", [tokenizer_id, after_rowid, upto]).fetchall()
        for rowid, pack, offset, num in rows:
            yield rowid, np.frombuffer(self.read(pack, offset, 4 * num), dtype="<i4").astype(np.int32)

    def token_rows(self, tokenizer_id: int, upto_rowid: int | None = None) -> tuple[int, int]:
        """(number of token rows, largest rowid) for a tokenizer, optionally up to a rowid."""
        count, last = self.db.execute(
            "SELECT count(*), coalesce(max(rowid), 0) FROM tokens WHERE tokenizer_id = ? AND rowid <= ?",
            [tokenizer_id, upto_rowid if upto_rowid is not None else 2**62]).fetchone()
        return int(count), int(last)

    def index_state(self, tokenizer_id: int) -> IndexState | None:
        row = self.db.execute("SELECT tokenizer_id, max_depth, num_calls, last_token_rowid, num_tokens FROM indexes"
                              " WHERE tokenizer_id = ?", [tokenizer_id]).fetchone()
        return IndexState(*row) if row else None

    def index_bytes(self, tokenizer_id: int) -> bytes:
        chunks = [row[0] for row in self.db.execute(
            "SELECT blob FROM index_chunks WHERE tokenizer_id = ? ORDER BY chunk", [tokenizer_id])]
        try:
            return codec.decompress(b"".join(chunks))
        except codec.BlobError as exc:
            raise StoreError(f"{self.path}: the persisted index of tokenizer {tokenizer_id} is {exc}") from None

    def stats(self) -> dict[str, Any]:
        """Counts and sizes for `specx ls`."""
        one = lambda sql: self.db.execute(sql).fetchone()[0]  # noqa: E731
        file_bytes = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal")) if p.exists())
        return {
            "path": str(self.path),
            "sources": one("SELECT count(*) FROM sources"),
            "sources_failed": one("SELECT count(*) FROM sources WHERE error IS NOT NULL"),
            "sessions": one("SELECT count(*) FROM sessions"),
            "calls": one("SELECT count(*) FROM calls"),
            "messages": one("SELECT count(*) FROM messages"),
            "output_bytes": one("SELECT coalesce(sum(output_bytes), 0) FROM calls"),
            "prompt_bytes": one("SELECT coalesce(sum(prompt_bytes), 0) FROM calls"),
            "raw_log_bytes": one("SELECT coalesce(sum(size_bytes), 0) FROM sources"),
            "disk_bytes": file_bytes,
            "tokenizers": [dict(r) for r in self.db.query(
                "SELECT t.name, t.fingerprint, count(k.call_id) AS calls, coalesce(sum(k.num_tokens), 0) AS tokens,"
                " i.num_tokens AS indexed_tokens FROM tokenizers t LEFT JOIN tokens k ON k.tokenizer_id = t.id"
                " LEFT JOIN indexes i ON i.tokenizer_id = t.id GROUP BY t.id ORDER BY t.name")],
            "by_format": [dict(r) for r in self.db.query(
                "SELECT format, count(*) AS sources, coalesce(sum(num_calls), 0) AS calls,"
                " coalesce(sum(size_bytes), 0) AS raw_bytes FROM sources GROUP BY format ORDER BY format")],
        }

    # ----------------------------------------------------------------- writing

    def save_index(self, state: IndexState, data: bytes) -> None:
        """Replace a tokenizer's persisted index in one transaction."""
        blob = codec.compress(data)
        chunks = [blob[i : i + INDEX_CHUNK_BYTES] for i in range(0, len(blob), INDEX_CHUNK_BYTES)] or [b""]
        with self.db.atomic():
            self.db.execute("DELETE FROM index_chunks WHERE tokenizer_id = ?", [state.tokenizer_id])
            self.db.execute(
                "INSERT OR REPLACE INTO indexes (tokenizer_id, max_depth, num_calls, last_token_rowid, num_tokens,"
                " raw_bytes, num_chunks, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, datetime('now'))",
                [state.tokenizer_id, state.max_depth, state.num_calls, state.last_token_rowid, state.num_tokens,
                 len(data), len(chunks)])
            self.db.conn.executemany(
                "INSERT INTO index_chunks (tokenizer_id, chunk, blob) VALUES (?, ?, ?)",
                [(state.tokenizer_id, i, c) for i, c in enumerate(chunks)])


class PackWriter:
    """Collects payloads of one kind into packs; use inside the transaction that writes their rows."""

    def __init__(self, store: Store, kind: str) -> None:
        self.store = store
        self.kind = kind
        self.pack_id: int | None = None
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> tuple[int, int]:
        """(pack id, offset) where `data` will be."""
        if self.pack_id is None or (self.size and self.size + len(data) > PACK_BYTES):
            self.flush()
            # The row is written now (rows referring to it need its id) and filled in by flush().
            self.pack_id = self.store.db.execute("INSERT INTO packs (kind, raw_bytes, data) VALUES (?, 0, x'')",
                                                 [self.kind]).lastrowid
        offset = self.size
        self.parts.append(data)
        self.size += len(data)
        return self.pack_id, offset  # type: ignore[return-value]

    def flush(self) -> None:
        if self.pack_id is not None:
            self.store.db.execute("UPDATE packs SET raw_bytes = ?, data = ? WHERE id = ?",
                                  [self.size, codec.compress(b"".join(self.parts)), self.pack_id])
        self.pack_id, self.parts, self.size = None, [], 0
