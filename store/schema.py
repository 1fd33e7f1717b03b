"""The store's schema: its migrations (the store's user_version counts them), and the checks a
store passes before anything is written to it: a schema this code knows, a file SQLite finds
healthy."""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

migrations = Migrations("specx")
MIGRATIONS: list[str] = []  # names of the migrations this code knows, in order


def migration(fn: Any) -> Any:
    """Register a schema migration (name it mNNN_what); the store's user_version counts them."""
    MIGRATIONS.append(fn.__name__)
    return migrations()(fn)


@migration
def m001_initial(db: Database) -> None:
    # Rows refer to each other by integer rowid (compact in tables and indexes); `key` columns hold
    # 16-byte content hashes, unique, which make ingest idempotent.
    db.executescript("""
    CREATE TABLE sources (
        id INTEGER PRIMARY KEY,
        key BLOB NOT NULL UNIQUE,       -- hash of (format, content sha256)
        path TEXT NOT NULL,
        format TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        ingested_at TEXT NOT NULL,
        num_calls INTEGER NOT NULL,
        num_errors INTEGER NOT NULL,
        error TEXT                      -- set when nothing in the file could be read
    );
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        key BLOB NOT NULL UNIQUE,       -- hash of (format, file name, session key, model)
        source_id INTEGER NOT NULL REFERENCES sources(id),
        session_key TEXT NOT NULL,
        format TEXT NOT NULL,
        model TEXT
    );
    CREATE TABLE packs (                -- zstd frames holding many payloads (one file's, up to 4 MiB raw)
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,             -- message | prompt | output | tokens
        raw_bytes INTEGER NOT NULL,
        data BLOB NOT NULL
    );
    CREATE TABLE messages (             -- each distinct prompt message once
        id INTEGER PRIMARY KEY,
        key BLOB NOT NULL UNIQUE,       -- hash of the message JSON
        pack_id INTEGER NOT NULL REFERENCES packs(id),
        pack_offset INTEGER NOT NULL,   -- the message JSON is pack[offset : offset + raw_bytes]
        raw_bytes INTEGER NOT NULL
    );
    CREATE TABLE calls (
        id INTEGER PRIMARY KEY,
        key BLOB NOT NULL UNIQUE,       -- hash of (session, position, agent, model, prompt, output)
        session_id INTEGER NOT NULL REFERENCES sessions(id),
        position INTEGER NOT NULL,
        agent TEXT,
        model TEXT,
        prompt_pack INTEGER REFERENCES packs(id), -- int32 message ids (NULL: no prompt recorded)
        prompt_offset INTEGER,
        num_messages INTEGER NOT NULL,
        prompt_bytes INTEGER NOT NULL,  -- size of the prompt messages as JSON
        output_pack INTEGER NOT NULL REFERENCES packs(id), -- UTF-8 output text
        output_offset INTEGER NOT NULL,
        output_bytes INTEGER NOT NULL,
        started_at TEXT,
        ended_at TEXT,
        line INTEGER,
        meta TEXT                       -- JSON, NULL when empty
    );
    CREATE INDEX calls_session_position ON calls(session_id, position);
    CREATE TABLE tokenizers (
        id INTEGER PRIMARY KEY,
        fingerprint TEXT NOT NULL UNIQUE, -- hash of the vocabulary
        name TEXT NOT NULL,
        vocab_size INTEGER NOT NULL,
        created_at TEXT NOT NULL
    );
    CREATE TABLE tokens (              -- output token ids per call per tokenizer; rowid = ingest order
        call_id INTEGER NOT NULL REFERENCES calls(id),
        tokenizer_id INTEGER NOT NULL REFERENCES tokenizers(id),
        num_tokens INTEGER NOT NULL,
        pack_id INTEGER NOT NULL REFERENCES packs(id), -- little-endian int32 at pack[offset : offset + 4 * num_tokens]
        pack_offset INTEGER NOT NULL,
        UNIQUE (tokenizer_id, call_id)
    );
    CREATE TABLE indexes (             -- the persisted global suffix index, one per tokenizer
        tokenizer_id INTEGER PRIMARY KEY REFERENCES tokenizers(id),
        max_depth INTEGER NOT NULL,
        num_calls INTEGER NOT NULL,     -- token rows covered, in rowid order ...
        last_token_rowid INTEGER NOT NULL, -- ... all with rowid <= this
        num_tokens INTEGER NOT NULL,
        raw_bytes INTEGER NOT NULL,
        num_chunks INTEGER NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE TABLE index_chunks (        -- zstd of the index without its text (the token rows hold that)
        tokenizer_id INTEGER NOT NULL REFERENCES indexes(tokenizer_id),
        chunk INTEGER NOT NULL,
        blob BLOB NOT NULL,
        PRIMARY KEY (tokenizer_id, chunk)
    );
    """)


@migration
def m002_successors(db: Database) -> None:
    db.executescript("""
    CREATE TABLE successors (          -- a model's successor table (core/index/successors.py), one per model
        model TEXT PRIMARY KEY,         -- the model's name and its tokenizer's fingerprint
        vocab_size INTEGER NOT NULL,
        k INTEGER NOT NULL,
        tokens INTEGER NOT NULL,        -- tokens with an entry
        updated_at TEXT NOT NULL,
        blob BLOB NOT NULL              -- zstd of SuccessorTable.to_bytes()
    );
    """)


@migration
def m003_tenants(db: Database) -> None:
    # The tenant whose history a source is ('' : the default, the one tenant of a server without
    # tenants; "public": shared corpora every tenant drafts from). store/tenants.py.
    db.executescript("""
    ALTER TABLE sources ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
    CREATE INDEX sources_tenant ON sources(tenant);
    """)


def schema_problem(conn: sqlite3.Connection) -> str | None:
    """Why this code must not use a store's schema (it is newer), or None. Reads only."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        return f"schema version {version} is newer than this specx's {len(MIGRATIONS)}"
    has_table = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                             [Migrations.migrations_table]).fetchone()
    if has_table:
        applied = [r[0] for r in conn.execute(f"SELECT name FROM {Migrations.migrations_table}"
                                              " WHERE migration_set = ?", [migrations.name])]
        unknown = [name for name in applied if name not in MIGRATIONS]
        if unknown:
            return f"migration {', '.join(unknown)} is newer than this specx"
    return None


def health_problems(conn: sqlite3.Connection, full: bool = False, limit: int = 100) -> list[str]:
    """What SQLite finds wrong with the file: quick_check (b-tree structure, every page read once),
    or with `full` integrity_check (indexes against their tables too); [] when healthy."""
    pragma = "integrity_check" if full else "quick_check"
    try:
        rows = [r[0] for r in conn.execute(f"PRAGMA {pragma}({int(limit)})")]
    except sqlite3.DatabaseError as exc:  # damage bad enough to stop the check itself
        return [str(exc)]
    if rows == ["ok"]:
        return []
    # Some SQLite versions put every problem into one row, a line each, under a heading.
    lines = [line for row in rows for line in str(row).splitlines()]
    return [line for line in lines if line.strip() and not line.startswith("*** in database")][:limit]
