"""`specx check`: the full health check of a store, read-only, saying what is wrong.

Opening a store runs only SQLite's quick_check. This goes further, in order, and stops before a
step whose input an earlier step found damaged:

1. schema: a SQLite file with specx's tables, not written by a newer specx;
2. integrity: SQLite's integrity_check (b-trees, and every index against its table);
3. packs: every pack decompresses to the size recorded for it;
4. calls: every call's output and prompt lie inside their packs;
5. token rows: every row lies inside its pack and holds ids inside its tokenizer's vocabulary;
6. each persisted index: it covers exactly the token rows it says, its chunks decompress to its
   recorded size, it loads with those rows as its text, and each segment's suffix array is the
   one sorting that text gives (a stale index, with rows added after it, is not a problem: the
   next command that reads it brings it up to date).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from ..core.index.suffix_array import build_suffix_array
from ..core.index.tokens import SuffixIndexError

from .db import IndexState, Store, StoreError, connect_readonly
from .index import load_persisted
from .schema import health_problems, schema_problem

TABLES = ("sources", "sessions", "packs", "messages", "calls", "tokenizers", "tokens", "indexes", "index_chunks")
MAX_LISTED = 20  # problems named per check; the rest are counted


@dataclass
class Check:
    name: str
    ok: bool = True
    detail: str = ""
    problems: list[str] = field(default_factory=list)
    num_problems: int = 0

    def problem(self, message: str) -> None:
        self.ok = False
        self.num_problems += 1
        if len(self.problems) < MAX_LISTED:
            self.problems.append(message)


@dataclass
class CheckReport:
    path: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "ok": self.ok,
                "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail, "num_problems": c.num_problems,
                            "problems": c.problems} for c in self.checks]}


def check_store(path: Path) -> CheckReport:
    """Every check above, on the store at `path` (which must exist); writes nothing."""
    report = CheckReport(str(path))
    schema = Check("schema")
    integrity = Check("integrity")
    report.checks += [schema, integrity]
    try:
        conn = connect_readonly(Path(path))  # immutable where no -shm can be made (a read-only folder)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: cannot open the store ({exc})") from None
    try:
        problem = schema_problem(conn)
        if problem:
            schema.problem(f"written by a newer specx: {problem}")
            return report
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for name in TABLES:
            if name not in tables:
                schema.problem(f"no {name} table (not a specx store?)")
        schema.detail = f"{len(tables)} tables"
        for line in health_problems(conn, full=True):
            integrity.problem(line)
        integrity.detail = "integrity_check ok" if integrity.ok else "integrity_check failed"
    except sqlite3.DatabaseError as exc:
        schema.problem(f"not a usable SQLite file ({exc})")
        return report
    finally:
        conn.close()
    if not report.ok:
        return report
    with Store(Path(path), readonly=True) as store:
        report.checks.append(_check_packs(store))
        report.checks.append(_check_calls(store))
        report.checks.append(_check_token_rows(store))
        for tokenizer_id, name in store.db.execute("SELECT tokenizer_id, t.name FROM indexes i"
                                                    " JOIN tokenizers t ON t.id = i.tokenizer_id").fetchall():
            report.checks.append(_check_index(store, tokenizer_id, name))
    return report


def _pack_sizes(store: Store, check: Check) -> dict[int, int]:
    """Decompressed size of every pack that decompresses (checked against its recorded size)."""
    sizes = {}
    for pack_id, raw_bytes in store.db.execute("SELECT id, raw_bytes FROM packs ORDER BY id").fetchall():
        try:
            size = len(store.read(pack_id, 0, raw_bytes + 1))
        except (zstandard.ZstdError, StoreError) as exc:
            check.problem(f"pack {pack_id} does not decompress ({exc})")
            continue
        if size != raw_bytes:
            check.problem(f"pack {pack_id} holds {size} bytes, {raw_bytes} recorded")
        sizes[pack_id] = size
    return sizes


def _check_packs(store: Store) -> Check:
    check = Check("packs")
    sizes = _pack_sizes(store, check)
    check.detail = f"{len(sizes):,} packs, {sum(sizes.values()):,} bytes"
    return check


def _inside(sizes: dict[int, int], pack: int, offset: int, length: int) -> bool:
    return pack in sizes and 0 <= offset and offset + length <= sizes[pack]


def _check_calls(store: Store) -> Check:
    check = Check("calls")
    sizes = {p: n for p, n in store.db.execute("SELECT id, raw_bytes FROM packs")}
    rows = store.db.execute("SELECT id, output_pack, output_offset, output_bytes, prompt_pack, prompt_offset,"
                            " num_messages FROM calls").fetchall()
    for cid, opack, ooffset, obytes, ppack, poffset, num_messages in rows:
        if not _inside(sizes, opack, ooffset, obytes):
            check.problem(f"call {cid}: output outside pack {opack}")
        if ppack is not None and not _inside(sizes, ppack, poffset, 4 * num_messages):
            check.problem(f"call {cid}: prompt outside pack {ppack}")
    check.detail = f"{len(rows):,} calls"
    return check


def _check_token_rows(store: Store) -> Check:
    check = Check("token rows")
    sizes = {p: n for p, n in store.db.execute("SELECT id, raw_bytes FROM packs")}
    vocab = {t: n for t, n in store.db.execute("SELECT id, vocab_size FROM tokenizers")}
    num_rows = num_tokens = 0
    rows = store.db.execute("SELECT rowid, call_id, tokenizer_id, num_tokens, pack_id, pack_offset FROM tokens"
                            " ORDER BY pack_id, pack_offset").fetchall()  # pack order: each decompressed once
    for rowid, cid, tid, num, pack, offset in rows:
        num_rows += 1
        if tid not in vocab:
            check.problem(f"token row {rowid} (call {cid}): unknown tokenizer {tid}")
            continue
        if not _inside(sizes, pack, offset, 4 * num):
            check.problem(f"token row {rowid} (call {cid}): {num} tokens outside pack {pack}")
            continue
        try:
            tokens = np.frombuffer(store.read(pack, offset, 4 * num), dtype="<i4")
        except (zstandard.ZstdError, StoreError) as exc:  # listed under packs too
            check.problem(f"token row {rowid} (call {cid}): unreadable ({exc})")
            continue
        num_tokens += len(tokens)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab[tid]):
            check.problem(f"token row {rowid} (call {cid}): ids outside the vocabulary of {vocab[tid]:,}")
    check.detail = f"{num_rows:,} rows, {num_tokens:,} tokens"
    return check


def _check_index(store: Store, tokenizer_id: int, name: str) -> Check:
    check = Check(f"index {name}")
    state: IndexState = store.index_state(tokenizer_id)  # type: ignore[assignment]
    count, _ = store.token_rows(tokenizer_id, state.last_token_rowid)
    if count != state.num_calls:
        check.problem(f"covers {state.num_calls:,} token rows up to row {state.last_token_rowid}, but the store has "
                      f"{count:,} there")
        return check
    num_chunks, raw_bytes = store.db.execute("SELECT num_chunks, raw_bytes FROM indexes WHERE tokenizer_id = ?",
                                             [tokenizer_id]).fetchone()
    have_chunks = store.db.execute("SELECT count(*) FROM index_chunks WHERE tokenizer_id = ?",
                                   [tokenizer_id]).fetchone()[0]
    if have_chunks != num_chunks:
        check.problem(f"{have_chunks} chunks stored, {num_chunks} recorded")
        return check
    try:
        data = store.index_bytes(tokenizer_id)
    except (zstandard.ZstdError, StoreError) as exc:
        check.problem(f"its chunks do not decompress ({exc})")
        return check
    if len(data) != raw_bytes:
        check.problem(f"{len(data):,} bytes, {raw_bytes:,} recorded")
        return check
    try:
        index = load_persisted(store, state)
    except (SuffixIndexError, ValueError, KeyError, IndexError) as exc:
        check.problem(f"does not load with its token rows as text ({exc})")
        return check
    if (index.num_sequences, index.num_tokens) != (state.num_calls, state.num_tokens):
        check.problem(f"holds {index.num_sequences:,} sequences and {index.num_tokens:,} tokens; recorded "
                      f"{state.num_calls:,} and {state.num_tokens:,}")
    # The segments are the index's own layout (online adds make more than a fresh build would):
    # each must hold the suffix array that sorting its text gives.
    for k, seg in enumerate(index.sealed.segments):
        expected = build_suffix_array(index.text()[seg.text_lo : seg.text_hi]) + seg.text_lo
        if not np.array_equal(index.sealed.sa[seg.sa_lo : seg.sa_hi], expected):
            check.problem(f"segment {k} (tokens {seg.text_lo:,}-{seg.text_hi:,}): suffix array is not the sorted one")
    stale = store.token_rows(tokenizer_id)[0] - count
    check.detail = (f"{state.num_calls:,} outputs, {state.num_tokens:,} tokens, {len(index.sealed.segments)} segments"
                    + (f"; {stale:,} newer token rows not in it yet" if stale else ""))
    return check
