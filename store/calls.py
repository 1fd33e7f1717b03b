"""Calls, their messages and their tokens in the store: the one write API that `specx ingest`
(store/ingest.py) and the served requests (store/served.py) share."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from .db import PackWriter, Store, content_key
from .formats import Call


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


def existing_id(store: Store, table: str, key: bytes) -> int | None:
    row = store.db.execute(f"SELECT id FROM {table} WHERE key = ?", [key]).fetchone()
    return None if row is None else row[0]


def insert_calls(store: Store, source_id: int, path: Path, fmt: str, calls: list[Call], scope: str | None = None,
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
                messages[mkey] = existing_id(store, "messages", mkey) or store.db.execute(
                    "INSERT INTO messages (key, pack_id, pack_offset, raw_bytes) VALUES (?, ?, ?, ?)",
                    [mkey, *message_pack.add(raw), len(raw)]).lastrowid
            message_ids.append(messages[mkey])
            message_keys.append(mkey.hex())
            prompt_bytes += len(raw)
        content = (call.position, call.agent, call.model, None if prompt is None else message_keys, call.output_text)
        ckey = content_key(skey.hex(), *content)
        cid = existing_id(store, "calls", ckey)
        if cid is None and legacy_scope is not None:
            old_skey = content_key(fmt, legacy_scope, call.session_id, call.model)
            cid = existing_id(store, "calls", content_key(old_skey.hex(), *content))
        if cid is None:
            if skey not in sessions:
                sessions[skey] = existing_id(store, "sessions", skey) or store.db.execute(
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


def ids_without_tokens(store: Store, call_ids: list[int], tokenizer_id: int) -> list[int]:
    have: set[int] = set()
    for part in _chunked(call_ids):
        marks = ",".join("?" * len(part))
        have.update(r[0] for r in store.db.execute(
            f"SELECT call_id FROM tokens WHERE tokenizer_id = ? AND call_id IN ({marks})", [tokenizer_id, *part]))
    return sorted(set(call_ids) - have)


def calls_missing_tokens(store: Store, source_id: int, tokenizer_id: int) -> bool:
    row = store.db.execute(
        "SELECT 1 FROM calls c JOIN sessions s ON s.id = c.session_id WHERE s.source_id = ? AND NOT EXISTS"
        " (SELECT 1 FROM tokens t WHERE t.call_id = c.id AND t.tokenizer_id = ?) LIMIT 1",
        [source_id, tokenizer_id]).fetchone()
    return row is not None
