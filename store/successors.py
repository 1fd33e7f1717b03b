"""Each model's successor table (core/index/successors.py) kept in the store beside the index:
loaded when a server or a run starts, saved as it learns, merged by `specx merge`, so a restarted
server and its replicas draft from a warm table."""

from __future__ import annotations

from ..core.index.successors import SuccessorTable, SuccessorTableError

from . import codec
from .db import Store, StoreError

MAX_TABLE_BYTES = 256 << 20  # a kept table's bytes (core.kept_schema's largest: 1 Mi tokens x 32 successors x 6 bytes)


def table_key(model_name: str, tokenizer_fingerprint: str) -> str:
    """The key a model's table is kept under: its name and its tokenizer's fingerprint."""
    return f"{model_name}|{tokenizer_fingerprint}"


def load_table(store: Store, key: str, vocab_size: int) -> SuccessorTable | None:
    """The table kept under `key`, or None when there is none; StoreError names a damaged one (a
    blob of another type, one that would expand past MAX_TABLE_BYTES, arrays that are not
    `vocab_size` x k: core.kept_schema.check_table, before anything is allocated)."""
    row = store.db.execute("SELECT blob FROM successors WHERE model = ?", [key]).fetchone()
    if row is None:
        return None
    blob = row[0]
    try:
        if not isinstance(blob, bytes):
            raise SuccessorTableError(f"damaged: its blob is stored as {_sql_type(blob)}")
        return SuccessorTable.from_bytes(codec.decompress(blob, MAX_TABLE_BYTES), vocab_size=vocab_size)
    except (codec.BlobError, SuccessorTableError) as exc:
        raise StoreError(f"{store.path}: the successor table of {key} is {exc}") from None


def _sql_type(value: object) -> str:
    return {str: "TEXT", int: "INTEGER", float: "REAL", type(None): "NULL"}.get(type(value), type(value).__name__)


def save_table(store: Store, key: str, table: SuccessorTable) -> None:
    """Keep `table` under `key`, replacing what was kept (one statement: whole or not at all)."""
    blob = codec.compress(table.to_bytes())
    with store.db.atomic():
        store.db.execute("INSERT OR REPLACE INTO successors (model, vocab_size, k, tokens, updated_at, blob)"
                         " VALUES (?, ?, ?, ?, datetime('now'), ?)", [key, table.vocab_size, table.k, len(table), blob])


def merge_tables(dest: Store, src: Store) -> tuple[list[str], list[str]]:
    """Take in `src`'s tables: a model `dest` has none of is copied, one both have is merged
    (SuccessorTable.merge). Returns the keys that changed, and one line for each table that was
    not taken in or was replaced, naming the store whose table is wrong: a damaged table of `src`
    (left out), one whose vocabulary is not that of `dest`'s table or of its own tokenizer (left
    out), a damaged table of `dest` (replaced by `src`'s: "damaged: starting a new table"). A line
    about `src`'s table does not name `src` (the caller says which store it merges)."""
    changed: list[str] = []
    problems: list[str] = []
    if src.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'successors'").fetchone() is None:
        return changed, problems  # a store older than the tables (opened read-only, not migrated)
    for key, vocab_size in src.db.execute("SELECT model, vocab_size FROM successors ORDER BY model").fetchall():
        try:
            if not isinstance(vocab_size, int):
                raise StoreError(f"the successor table of {key} is damaged: its vocab_size is {_sql_type(vocab_size)}")
            theirs = load_table(src, key, vocab_size)
            tokens = _tokenizer_vocab(src, key)
            if theirs is None:
                continue  # gone since it was listed
            if tokens is not None and theirs.vocab_size < tokens:
                raise StoreError(f"the successor table of {key} is for a vocabulary of {vocab_size:,} tokens, "
                                 f"fewer than its tokenizer's {tokens:,}")
        except StoreError as exc:
            problems.append(f"{str(exc).removeprefix(f'{src.path}: ')}: not merged")
            continue
        mine_size = dest.db.execute("SELECT vocab_size FROM successors WHERE model = ?", [key]).fetchone()
        try:
            mine = load_table(dest, key, mine_size[0]) if mine_size and isinstance(mine_size[0], int) else None
        except StoreError as exc:
            problems.append(f"{exc}: starting a new table from this store's")
            mine = None
        if mine is not None and mine.vocab_size != theirs.vocab_size:
            problems.append(f"the successor table of {key} is for a vocabulary of {theirs.vocab_size:,} tokens, "
                            f"{dest.path}'s of {mine.vocab_size:,}: not merged")
            continue
        if mine is not None:
            mine.merge(theirs)
        save_table(dest, key, mine if mine is not None else theirs)
        changed.append(key)
    return changed, problems


def _tokenizer_vocab(store: Store, key: str) -> int | None:
    """The vocabulary `store` recorded for the tokenizer in a table's key (model|fingerprint), or None."""
    row = store.db.execute("SELECT vocab_size FROM tokenizers WHERE fingerprint = ?", [key.rpartition("|")[2]]).fetchone()
    return row[0] if row and isinstance(row[0], int) else None
