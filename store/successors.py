"""Each model's successor table (core/index/successors.py) kept in the store beside the index:
loaded when a server or a run starts, saved as it learns, merged by `specx merge`, so a restarted
server and its replicas draft from a warm table."""

from __future__ import annotations

from specx.core.index.successors import SuccessorTable, SuccessorTableError

from . import codec
from .db import Store, StoreError


def table_key(model_name: str, tokenizer_fingerprint: str) -> str:
    """The key a model's table is kept under: its name and its tokenizer's fingerprint."""
    return f"{model_name}|{tokenizer_fingerprint}"


def load_table(store: Store, key: str, vocab_size: int) -> SuccessorTable | None:
    """The table kept under `key`, or None when there is none; StoreError names a damaged one."""
    row = store.db.execute("SELECT blob FROM successors WHERE model = ?", [key]).fetchone()
    if row is None:
        return None
    try:
        return SuccessorTable.from_bytes(codec.decompress(row[0]), vocab_size=vocab_size)
    except (codec.BlobError, SuccessorTableError) as exc:
        raise StoreError(f"{store.path}: the successor table of {key} is {exc}") from None


def save_table(store: Store, key: str, table: SuccessorTable) -> None:
    """Keep `table` under `key`, replacing what was kept (one statement: whole or not at all)."""
    blob = codec.compress(table.to_bytes())
    with store.db.atomic():
        store.db.execute("INSERT OR REPLACE INTO successors (model, vocab_size, k, tokens, updated_at, blob)"
                         " VALUES (?, ?, ?, ?, datetime('now'), ?)", [key, table.vocab_size, table.k, len(table), blob])


def merge_tables(dest: Store, src: Store) -> list[str]:
    """Take in `src`'s tables: a model `dest` has none of is copied, one both have is merged
    (SuccessorTable.merge). Returns the keys that changed; a damaged table of `src` raises
    StoreError (naming it) and leaves `dest`'s as it was."""
    changed: list[str] = []
    if src.db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'successors'").fetchone() is None:
        return changed  # a store older than the tables (opened read-only, not migrated)
    for key, vocab_size in src.db.execute("SELECT model, vocab_size FROM successors ORDER BY model").fetchall():
        theirs = load_table(src, key, vocab_size)
        mine = load_table(dest, key, vocab_size)
        if mine is not None and theirs is not None:
            mine.merge(theirs)
        save_table(dest, key, mine if mine is not None else theirs)  # type: ignore[arg-type]
        changed.append(key)
    return changed
