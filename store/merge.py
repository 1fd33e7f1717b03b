"""`specx merge`: the calls of other stores (replicas that served on other machines, a colleague's
ingest) into this one.

Rows are matched by their content keys, so a call both stores hold (from a common seed, or merged
before) is not copied again, and merging twice adds nothing. A copied call keeps its session and
source keys, its prompt messages (each distinct message once) and its token rows for every
tokenizer the other store has; a call both hold gains the token rows it lacks. Each source of the
other store is copied in one transaction, so an interrupted merge leaves whole sources. The
persisted index of each tokenizer that gained token rows is brought up to date at the end, and each
model's successor table is copied, or merged with this store's (store/successors.py).

Each source keeps its tenant (store/tenants.py), or with `tenant` every source goes into that
tenant's history: a source of another tenant then gets the key it would have there (a log's: what
`specx ingest --tenant` gives it; a corpus's: its name in the tenant), and its sessions and calls
keys derived from theirs and the tenant, so two tenants merging one store hold separate rows, and
merging it again adds nothing. A source whose key another tenant holds in `dest` gets derived keys
too: no row is shared between tenants.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .calls import existing_id, insert_tokens
from .db import PackWriter, Store, StoreError, content_key
from .index import update_index
from .successors import merge_tables
from .tenants import CORPUS_FORMAT, DEFAULT, check_tenant, corpus_key, source_key


@dataclass
class MergeReport:
    sources: int = 0  # sources of the other store read
    new_sources: int = 0
    new_sessions: int = 0
    new_calls: int = 0
    known_calls: int = 0  # already in this store
    new_messages: int = 0
    new_token_rows: int = 0
    tokenizers: dict[int, str] = field(default_factory=dict)  # this store's id -> name, of those that gained rows
    damaged: list[str] = field(default_factory=list)  # sources of the other store not merged: a block is damaged
    successor_tables: list[str] = field(default_factory=list)  # models whose successor table was copied or merged

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tokenizers"} | {
            "tokenizers": sorted(self.tokenizers.values())}


def merge(dest: Store, src: Store, on_source: Callable[[str], None] = lambda path: None,
          tenant: str | None = None) -> MergeReport:
    """Copy into `dest` what `src` holds and `dest` lacks; update `dest`'s indexes. `tenant`: into
    that tenant's history (None: each source into its own tenant's)."""
    if dest.path.resolve() == src.path.resolve():
        raise ValueError(f"{src.path}: a store cannot be merged into itself")
    if tenant not in (None, DEFAULT):
        check_tenant(tenant)
    report = MergeReport()
    tokenizers = [(tid, fp, name, vocab) for tid, fp, name, vocab in
                  src.db.execute("SELECT id, fingerprint, name, vocab_size FROM tokenizers ORDER BY id")]
    for source in list(src.db.query("SELECT * FROM sources ORDER BY id")):
        on_source(source["path"])
        report.sources += 1
        done = MergeReport(tokenizers=report.tokenizers)
        try:
            with dest.db.atomic():  # a damaged block leaves this source out whole, and the others go on
                tokenizer_ids = {tid: dest.add_tokenizer(fp, name, vocab) for tid, fp, name, vocab in tokenizers}
                _merge_source(dest, src, source, tokenizer_ids, done, tenant)
        except StoreError as exc:
            report.damaged.append(f"{source['path']}: not merged: {exc}")
            continue
        for name in ("new_sources", "new_sessions", "new_calls", "known_calls", "new_messages", "new_token_rows"):
            setattr(report, name, getattr(report, name) + getattr(done, name))
    for tid in report.tokenizers:
        update_index(dest, tid)
    report.successor_tables, problems = merge_tables(dest, src)
    report.damaged += problems
    return report


class _Keys:
    """The keys a source's rows get in `dest`: their own (the source stays in its tenant), or,
    moved into another tenant, the source's key there and its sessions' and calls' derived from
    theirs and the tenant (a session's key hashes a scope that the store does not keep)."""

    def __init__(self, source: dict[str, Any], tenant: str | None) -> None:
        own = source.get("tenant", DEFAULT)  # a store from before tenants has no column: the default's
        self.tenant = own if tenant is None else tenant
        self.moved = self.tenant != own
        key, fmt, sha = source["key"], source["format"], source["sha256"]
        self.source = key
        if self.moved:
            corpus = source["path"].removeprefix("corpus/")
            if sha and key == source_key(fmt, sha, own):
                self.source = source_key(fmt, sha, self.tenant)
            elif fmt == CORPUS_FORMAT and key == corpus_key(own, corpus):
                self.source = corpus_key(self.tenant, corpus)
            else:
                self.source = self(key)

    def __call__(self, key: bytes) -> bytes:
        return content_key("tenant", self.tenant, key.hex()) if self.moved else key


def _merge_source(dest: Store, src: Store, source: dict[str, Any], tokenizer_ids: dict[int, int],
                  report: MergeReport, tenant: str | None = None) -> None:
    keys = _Keys(source, tenant)
    held = dest.db.execute("SELECT tenant FROM sources WHERE key = ?", [keys.source]).fetchone()
    if held is not None and held[0] != keys.tenant:  # a key without the tenant in it, held by another: kept apart
        keys.moved = True
        keys.source = keys(keys.source)
    source_id = existing_id(dest, "sources", keys.source)
    if source_id is None:
        source_id = dest.db.execute(
            "INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls, num_errors, error,"
            " tenant) VALUES (?, ?, ?, ?, ?, ?, 0, ?, ?, ?)",
            [keys.source, source["path"], source["format"], source["sha256"], source["size_bytes"],
             source["ingested_at"], source["num_errors"], source["error"], keys.tenant]).lastrowid
        report.new_sources += 1
    messages = {}  # src message id -> dest message id
    packs = {kind: PackWriter(dest, kind) for kind in ("message", "prompt", "output")}
    copied = 0
    token_rows: dict[int, list[tuple[int, np.ndarray]]] = {}
    for session in list(src.db.query("SELECT * FROM sessions WHERE source_id = ? ORDER BY id", [source["id"]])):
        session_id = existing_id(dest, "sessions", keys(session["key"]))
        if session_id is None:
            session_id = dest.db.execute(
                "INSERT INTO sessions (key, source_id, session_key, format, model) VALUES (?, ?, ?, ?, ?)",
                [keys(session["key"]), source_id, session["session_key"], session["format"], session["model"]]).lastrowid
            report.new_sessions += 1
        for call in list(src.db.query("SELECT * FROM calls WHERE session_id = ? ORDER BY id", [session["id"]])):
            call["key"] = keys(call["key"])
            call_id = existing_id(dest, "calls", call["key"])
            if call_id is None:
                call_id = _copy_call(dest, src, call, session_id, messages, packs, report)
                copied += 1
            else:
                report.known_calls += 1
            for src_tid, dest_tid in tokenizer_ids.items():
                tokens = src.call_tokens(call["id"], src_tid)
                if tokens is not None and dest.db.execute(
                        "SELECT 1 FROM tokens WHERE call_id = ? AND tokenizer_id = ?", [call_id, dest_tid]).fetchone() is None:
                    token_rows.setdefault(dest_tid, []).append((call_id, tokens))
    for writer in packs.values():
        writer.flush()
    for dest_tid, rows in token_rows.items():
        insert_tokens(dest, dest_tid, rows)
        report.new_token_rows += len(rows)
        report.tokenizers[dest_tid] = dest.db.execute("SELECT name FROM tokenizers WHERE id = ?",
                                                      [dest_tid]).fetchone()[0]
    if copied:
        dest.db.execute("UPDATE sources SET num_calls = num_calls + ? WHERE id = ?", [copied, source_id])
    report.new_calls += copied


def _copy_call(dest: Store, src: Store, call: dict[str, Any], session_id: int, messages: dict[int, int],
               packs: dict[str, PackWriter], report: MergeReport) -> int:
    prompt_ids = src.call_prompt_ids(call["id"])
    prompt_pack = prompt_offset = None
    if prompt_ids is not None:
        mapped = []
        for mid in prompt_ids:
            if mid not in messages:
                key, pack, offset, length = src.db.execute(
                    "SELECT key, pack_id, pack_offset, raw_bytes FROM messages WHERE id = ?", [mid]).fetchone()
                found = existing_id(dest, "messages", key)
                if found is None:
                    found = dest.db.execute(
                        "INSERT INTO messages (key, pack_id, pack_offset, raw_bytes) VALUES (?, ?, ?, ?)",
                        [key, *packs["message"].add(src.read(pack, offset, length)), length]).lastrowid
                    report.new_messages += 1
                messages[mid] = found
            mapped.append(messages[mid])
        prompt_pack, prompt_offset = packs["prompt"].add(np.asarray(mapped, dtype="<i4").tobytes())
    output = src.read(call["output_pack"], call["output_offset"], call["output_bytes"])
    return dest.db.execute(
        "INSERT INTO calls (key, session_id, position, agent, model, prompt_pack, prompt_offset, num_messages,"
        " prompt_bytes, output_pack, output_offset, output_bytes, started_at, ended_at, line, meta)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [call["key"], session_id, call["position"], call["agent"], call["model"], prompt_pack, prompt_offset,
         call["num_messages"], call["prompt_bytes"], *packs["output"].add(output), call["output_bytes"],
         call["started_at"], call["ended_at"], call["line"], call["meta"]]).lastrowid
