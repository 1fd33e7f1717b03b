"""Corpora over HTTP, in the caller's tenant (as SGLang's n-gram speculation has them):

    POST   /v1/corpus        {"name": "docs", "texts": ["...", ...]}  or  {"name": ..., "token_ids": [[...], ...]}
    GET    /v1/corpus        {"object": "list", "data": [{"name", "texts", "tokens", "bytes", "created_at"}, ...]}
    DELETE /v1/corpus/NAME   {"name": "docs", "object": "corpus", "deleted": true}

A corpus is stored like ingested logs (store/tenants.add_corpus: one transaction; a second POST
of a name replaces it) and drafts the tenant's requests from the next step on (the store's watcher
hands it to the scopes). DELETE removes its rows from the store and rebuilds the tenant's index
without them before it answers. Sizes are bounded (a corpus, the corpora of a tenant, the tokens a
tenant may write a minute: writes cost every tenant, as they tokenize and rebuild); bad input is a
400 naming the field, a tenant over its budget 400, over its rate 429.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import ApiError

MAX_TEXTS = 10_000  # texts (or token lists) in one corpus
MAX_TOKENS = 2_000_000  # tokens in one corpus
MAX_CHARS = 4 * MAX_TOKENS  # characters of one corpus's texts, refused before any is tokenized (~4-5 a token)
MAX_CORPORA = 100  # corpora of one tenant
WRITE_WINDOW_S = 60.0  # a tenant writes at most its --tenant-tokens in corpora in this long (a token bucket)
REBUILD_WAIT_S = 60.0


class Corpora:
    """The corpus routes of a server whose store is at `db`; `api` authorizes (its tenant) and
    holds the tokenizers; once loaded, `start` names the tokenizer and the store's watcher
    (store/watch.StoreWatcher; until then `api` answers 503 loading)."""

    def __init__(self, api: Any, db: Path, tenant_tokens: int) -> None:  # serve --tenant-tokens
        self.api, self.db, self.tenant_tokens = api, Path(db), int(tenant_tokens)
        self._writes: dict[str, tuple[float, float]] = {}  # tenant -> (tokens it may write now, when that was)
        self._writes_lock = threading.Lock()  # (charged on the event loop and on the threads that store)
        self.fingerprint: str | None = None
        self.watcher: Any = None
        self._tokenizer: Any = None  # a copy of the server's, for corpora alone (its lock is the decoding thread's)
        self._tokenizer_lock = threading.Lock()

    def start(self, fingerprint: str, watcher: Any) -> None:
        self.fingerprint, self.watcher = fingerprint, watcher

    async def add(self, request: Request) -> Response:
        async def make() -> Response:
            tenant = self.api.tenant_of(request)
            body = await self.api.json_body(request)
            self._rate(tenant, 0)  # an empty bucket: refused before the body is read into tokens
            name, texts, tokens = await asyncio.to_thread(self._parse, body)
            info = await asyncio.to_thread(self._store, tenant, name, texts, tokens)
            self.watcher.poke()
            return JSONResponse({"object": "corpus", **info}, status_code=201)
        return await self.api.answer_async("corpus", request, make)

    async def list(self, request: Request) -> Response:
        async def make() -> Response:
            tenant = self.api.tenant_of(request)
            return JSONResponse({"object": "list", "data": await asyncio.to_thread(self._list, tenant)})
        return await self.api.answer_async("corpus", request, make)

    async def remove(self, request: Request) -> Response:
        async def make() -> Response:
            tenant = self.api.tenant_of(request)
            name = request.path_params["name"]
            if not await asyncio.to_thread(self._remove, tenant, name):
                raise ApiError(404, f"No corpus named {name!r} in your tenant.", "name", "corpus_not_found")
            done = self.watcher.rebuild([tenant] if self.api.tenants else None)
            if not await asyncio.to_thread(done.wait, REBUILD_WAIT_S):
                raise ApiError(503, "The corpus was deleted from the store, but the index is still being rebuilt; "
                                    "it drafts no request once that ends.", None, "rebuilding", "server_error")
            return JSONResponse({"object": "corpus", "name": name, "deleted": True})
        return await self.api.answer_async("corpus", request, make)

    def _rate(self, tenant: str, tokens: int) -> None:
        """Charge `tenant` a corpus write of `tokens`: a token bucket holding its --tenant-tokens,
        refilled in WRITE_WINDOW_S; 429 with the seconds to wait when it lacks them."""
        with self._writes_lock:
            now, rate = time.monotonic(), self.tenant_tokens / WRITE_WINDOW_S
            held, at = self._writes.get(tenant, (float(self.tenant_tokens), now))
            held = min(float(self.tenant_tokens), held + (now - at) * rate)
            if held <= 0 or tokens > held:
                wait = math.ceil((max(tokens, 1) - held) / rate)
                raise ApiError(429, f"Your tenant writes corpora faster than the server takes them "
                                    f"({self.tenant_tokens:,} tokens a minute); retry in {wait} s.", None,
                               "rate_limit_exceeded", retry_after=wait)
            self._writes[tenant] = (held - tokens, now)

    # ---- off the event loop

    def _parse(self, body: Any) -> tuple[str, list[str], list[Any]]:
        from ..store.tenants import check_tenant

        if not isinstance(body, dict):
            raise ApiError(400, "The body must be a JSON object: {\"name\": ..., \"texts\": [...]}.", None)
        name = body.get("name")
        try:
            check_tenant(name, "corpus")
        except ValueError as exc:
            raise ApiError(400, str(exc), "name") from None
        unknown = sorted(set(body) - {"name", "texts", "token_ids"})
        if unknown:
            raise ApiError(400, f"Unknown field {unknown[0]!r}: a corpus has a name and texts or token_ids.", unknown[0])
        if ("texts" in body) == ("token_ids" in body):
            raise ApiError(400, "Give exactly one of 'texts' (strings) or 'token_ids' (lists of token ids).", "texts")
        field = "texts" if "texts" in body else "token_ids"
        items = body[field]
        if not isinstance(items, list) or not items:
            raise ApiError(400, f"'{field}' must be a non-empty list.", field)
        if len(items) > MAX_TEXTS:
            raise ApiError(400, f"'{field}' holds {len(items):,} items; a corpus takes at most {MAX_TEXTS:,}.", field)
        tokenizer = self.api.tokenizers.tokenizer
        if field == "texts":
            for i, text in enumerate(items):
                if not isinstance(text, str) or not text:
                    raise ApiError(400, f"'texts[{i}]' must be a non-empty string.", f"texts[{i}]")
            chars = sum(len(text) for text in items)
            if chars > MAX_CHARS:  # before tokenizing: a huge body must not hold a core for seconds to be refused
                raise ApiError(400, f"The corpus has {chars:,} characters; at most {MAX_CHARS:,} are taken.", field)
            from ..store.ingest import encode_texts

            with self._tokenizer_lock:  # a tokenizer of its own: the decoding thread's streams never wait on it
                if self._tokenizer is None:
                    with tokenizer.lock:
                        self._tokenizer = copy.deepcopy(tokenizer.tokenizer)
                tokens = encode_texts(self._tokenizer, items)  # encoded as ingest does
            texts = list(items)
        else:
            vocab = self.api.tokenizers.vocab_size
            for i, ids in enumerate(items):
                if not isinstance(ids, list) or not ids or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                    raise ApiError(400, f"'token_ids[{i}]' must be a non-empty list of token ids in [0, {vocab}).",
                                   f"token_ids[{i}]")
            tokens = items
            texts = [tokenizer.decode(ids) for ids in items]
        total = sum(len(t) for t in tokens)
        if total > MAX_TOKENS:
            raise ApiError(400, f"The corpus has {total:,} tokens; at most {MAX_TOKENS:,} are taken.", field)
        return name, texts, tokens

    def _store(self, tenant: str, name: str, texts: list[str], tokens: list[Any]) -> dict[str, Any]:
        from ..store.db import Store
        from ..store.tenants import add_corpus, list_corpora

        with Store(self.db) as store:
            held = {c["name"]: c["tokens"] for c in list_corpora(store, tenant)}
            if name not in held and len(held) >= MAX_CORPORA:
                raise ApiError(400, f"Your tenant has {len(held)} corpora, the most it may keep: delete one first.",
                               "name")
            adding = sum(len(t) for t in tokens)
            total = sum(n for other, n in held.items() if other != name) + adding
            if total > self.tenant_tokens:
                raise ApiError(400, f"Your tenant's corpora would hold {total:,} tokens; it may keep "
                                    f"{self.tenant_tokens:,}: delete one first.", "texts")
            self._rate(tenant, adding)  # (a removal is not charged: each needs a write first)
            tok = self.api.tokenizers
            return add_corpus(store, tenant, name, texts, tokens, (self.fingerprint, self.api.model_names[0],
                                                                   tok.vocab_size))

    def _list(self, tenant: str) -> list[dict[str, Any]]:
        from ..store.db import Store
        from ..store.tenants import list_corpora

        with Store(self.db, readonly=True) as store:
            return list_corpora(store, tenant)

    def _remove(self, tenant: str, name: str) -> bool:
        from ..store.db import Store
        from ..store.tenants import remove_corpus

        with Store(self.db) as store:
            return remove_corpus(store, tenant, name)
