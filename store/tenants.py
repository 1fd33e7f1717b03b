"""Tenants in the store: whose history each source is, the corpora a tenant adds over HTTP, and
the reads a live server follows the store with.

Every source has a tenant (schema m003): '' is the default (the one tenant of a server without
tenants, and every store written before tenants), PUBLIC holds shared corpora that every tenant's
requests draft from and none learns into. A tenant's history never drafts another tenant's request
(core/serve/scopes.py); the keys that make ingest idempotent carry the tenant, so the same file
ingested for two tenants is two histories.

>>> check_tenant("team-a"), source_key("jsonl", "ab", "") == source_key("jsonl", "ab", "team-a")
('team-a', False)
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import codec
from .calls import insert_calls, insert_tokens
from .db import Store, content_key
from .formats import Call

DEFAULT = ""
PUBLIC = "public"
CORPUS_FORMAT = "corpus"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_tenant(name: str, what: str = "tenant") -> str:
    """A tenant (or corpus) name: 1-64 letters, digits, '_', '.', '-', starting with a letter or
    digit; ValueError naming it otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
                         f"or digit)")
    return name


def source_key(fmt: str, sha: str, tenant: str) -> bytes:
    """The key of a source (a file's content in a format) in a tenant's history; the default
    tenant's is the key stores had before tenants, so they stay idempotent."""
    return content_key(fmt, sha) if tenant == DEFAULT else content_key(fmt, sha, tenant)


def session_scope(scope: str, tenant: str) -> str:
    """What keys a file's sessions (store/calls.insert_calls' `scope`) in a tenant's history."""
    return scope if tenant == DEFAULT else f"{tenant}\0{scope}"


def data_version(conn: sqlite3.Connection) -> int:
    """SQLite's data_version: it changes when another connection commits to the file (a cheap check
    between steps: no table is read)."""
    return int(conn.execute("PRAGMA data_version").fetchone()[0])


@dataclass(frozen=True)
class Row:
    """A token row of the store: rowid, the tenant whose history it is, the output tokens, and
    whether it belongs to a corpus (its name) or a log."""

    rowid: int
    tenant: str
    tokens: np.ndarray
    corpus: str | None = None


def token_rows(store: Store, tokenizer_id: int, after_rowid: int = 0, tenants: Sequence[str] | None = None,
               skip: Callable[[str, str], bool] | None = None, upto_rowid: int | None = None) -> list[Row]:
    """The token rows in (after_rowid, upto_rowid] (oldest first) of `tenants` (None: all), leaving
    out those `skip(format, session_key)` says (a server's own requests, which it learned already)."""
    where, args = "t.tokenizer_id = ? AND t.rowid > ? AND t.rowid <= ?", [
        tokenizer_id, after_rowid, upto_rowid if upto_rowid is not None else 2**62]
    if tenants is not None:
        where += f" AND src.tenant IN ({','.join('?' * len(tenants))})"
        args += list(tenants)
    rows = store.db.execute(
        "SELECT t.rowid, src.tenant, t.pack_id, t.pack_offset, t.num_tokens, s.format, s.session_key"
        " FROM tokens t JOIN calls c ON c.id = t.call_id JOIN sessions s ON s.id = c.session_id"
        f" JOIN sources src ON src.id = s.source_id WHERE {where} ORDER BY t.rowid", args).fetchall()
    out = []
    for rowid, tenant, pack, offset, num, fmt, session in rows:
        if skip is not None and skip(fmt, session):
            continue
        tokens = np.frombuffer(store.read(pack, offset, 4 * num), dtype="<i4").astype(np.int32)
        out.append(Row(rowid, tenant, tokens, session if fmt == CORPUS_FORMAT else None))
    return out


def tenant_row_counts(store: Store, tokenizer_id: int, upto_rowid: int) -> dict[str, int]:
    """How many token rows up to `upto_rowid` each tenant has (a watcher's check of whose rows went away)."""
    rows = store.db.execute(
        "SELECT src.tenant, count(*) FROM tokens t JOIN calls c ON c.id = t.call_id JOIN sessions s ON"
        " s.id = c.session_id JOIN sources src ON src.id = s.source_id WHERE t.tokenizer_id = ? AND t.rowid <= ?"
        " GROUP BY src.tenant", [tokenizer_id, upto_rowid]).fetchall()
    return {tenant: int(n) for tenant, n in rows}


def last_rowid(store: Store, tokenizer_id: int) -> int:
    return store.token_rows(tokenizer_id)[1]


def tenants_in(store: Store) -> dict[str, int]:
    """Each tenant with a source in the store, and its number of calls."""
    return {tenant: int(n) for tenant, n in store.db.execute(
        "SELECT tenant, coalesce(sum(num_calls), 0) FROM sources GROUP BY tenant ORDER BY tenant")}


# --------------------------------------------------------------------------- corpora

def corpus_key(tenant: str, name: str) -> bytes:
    """The key of a tenant's corpus source (a second POST of the name replaces it)."""
    return content_key(CORPUS_FORMAT, tenant, name)


def _corpus_source(store: Store, tenant: str, name: str) -> int | None:
    row = store.db.execute("SELECT id FROM sources WHERE key = ?", [corpus_key(tenant, name)]).fetchone()
    return None if row is None else int(row[0])


def add_corpus(store: Store, tenant: str, name: str, texts: list[str], tokens: list[Sequence[int]],
               tokenizer: tuple[str, str, int]) -> dict[str, Any]:
    """Store a corpus (replacing one of that name in the tenant) in one transaction: each text one
    call of one session named after the corpus, with its tokens for `tokenizer` (fingerprint, name,
    vocabulary size). Returns what list_corpora says of it."""
    if tenant != DEFAULT:
        check_tenant(tenant)
    check_tenant(name, "corpus")
    fingerprint, tokenizer_name, vocab_size = tokenizer
    with store.db.atomic():
        _remove(store, tenant, name)
        tokenizer_id = store.add_tokenizer(fingerprint, tokenizer_name, vocab_size)
        source_id = store.db.execute(
            "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error,"
            " tenant) VALUES (?, ?, ?, '', ?, datetime('now'), ?, 0, NULL, ?)",
            [corpus_key(tenant, name), f"corpus/{name}", CORPUS_FORMAT, sum(len(t.encode("utf-8", "surrogatepass")) for t in texts),
             len(texts), tenant]).lastrowid
        calls = [Call(session_id=name, position=i, output_text=text) for i, text in enumerate(texts)]
        call_ids, _ = insert_calls(store, source_id, Path("corpus") / name, CORPUS_FORMAT, calls,
                                   scope=session_scope(f"corpus/{name}", tenant))
        insert_tokens(store, tokenizer_id, list(zip(call_ids, tokens)))
    return next(c for c in list_corpora(store, tenant) if c["name"] == name)


def list_corpora(store: Store, tenant: str) -> list[dict[str, Any]]:
    """The tenant's corpora: name, texts, tokens, bytes, when added."""
    rows = store.db.execute(
        "SELECT src.path, src.num_calls, src.size_bytes, src.ingested_at, coalesce(sum(t.num_tokens), 0)"
        " FROM sources src LEFT JOIN sessions s ON s.source_id = src.id LEFT JOIN calls c ON c.session_id = s.id"
        " LEFT JOIN tokens t ON t.call_id = c.id WHERE src.format = ? AND src.tenant = ? GROUP BY src.id"
        " ORDER BY src.path", [CORPUS_FORMAT, tenant]).fetchall()
    return [{"name": path.removeprefix("corpus/"), "texts": n, "tokens": int(tokens), "bytes": size,
             "created_at": at} for path, n, size, at, tokens in rows]


def remove_corpus(store: Store, tenant: str, name: str) -> bool:
    """Delete a tenant's corpus and everything stored for it (calls, tokens, their packs), in one
    transaction; False when it has none of that name."""
    store.db.execute("PRAGMA secure_delete = ON")  # the freed pages are overwritten, not left in the file
    with store.db.atomic():
        return _remove(store, tenant, name)


def _remove(store: Store, tenant: str, name: str) -> bool:
    source_id = _corpus_source(store, tenant, name)
    if source_id is None:
        return False
    db = store.db
    calls = "SELECT c.id FROM calls c JOIN sessions s ON s.id = c.session_id WHERE s.source_id = ?"
    packs = {r[0] for r in db.execute(f"SELECT pack_id FROM tokens WHERE call_id IN ({calls})", [source_id])}
    packs |= {r[0] for r in db.execute(f"SELECT output_pack FROM calls WHERE id IN ({calls})", [source_id])}
    db.execute(f"DELETE FROM tokens WHERE call_id IN ({calls})", [source_id])
    db.execute(f"DELETE FROM calls WHERE id IN ({calls})", [source_id])
    db.execute("DELETE FROM sessions WHERE source_id = ?", [source_id])
    db.execute("DELETE FROM sources WHERE id = ?", [source_id])
    empty = codec.compress(b"")
    for pack in packs:  # a corpus's packs are its own (written in its transaction): emptied unless shared
        if not db.execute("SELECT 1 FROM tokens WHERE pack_id = ? UNION ALL SELECT 1 FROM calls WHERE output_pack = ?"
                          " LIMIT 1", [pack, pack]).fetchone():
            # emptied, not deleted: a deleted last row's id would be reused, and a reader that cached
            # the old pack under that id would read the wrong bytes
            db.execute("UPDATE packs SET raw_bytes = 0, data = ? WHERE id = ?", [empty, pack])
    return True
