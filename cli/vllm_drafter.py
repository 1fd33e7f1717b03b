"""specx's drafter inside vLLM (`EngineDrafter`, vLLM's `SuffixDecodingCache` as cli/vllm.py installs
it): the store's global index, each request's drafts, and the store's writer; its settings come
from the environment (cli/vllm.py's docstring lists them). Nothing heavy is imported at load: vLLM
loads this in every process, before its CPU kernel set-up, whose scan of loaded modules trips over
numba's, so specx's core is imported when the engine builds its drafter.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing.util
import os
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.specx")  # under vLLM's logger: its handlers print it in the engine's log

DEFAULT_INDEX_BYTES = 4 << 30


class SpecxVllmError(RuntimeError):
    """specx cannot draft for this vLLM engine; the message says why and what to do."""


DRAFTERS: "weakref.WeakSet[EngineDrafter]" = weakref.WeakSet()  # this process's drafters
FINISHES = {"hooked": False}  # whether the model runner passes on the scheduler's finished request ids


def parse_bytes(text: str) -> int:
    """'4G' -> 4 * 2**30; plain digits are bytes. ValueError names the setting."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise SpecxVllmError(f"specx: SPECX_INDEX_BYTES={text!r} is not a size (e.g. 2G, 512M)") from None
    if value < 0:
        raise SpecxVllmError(f"specx: SPECX_INDEX_BYTES={text!r} must not be negative")
    return int(value)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SpecxVllmError(f"specx: {name}={raw!r} is not a number") from None
    if value < 0:
        raise SpecxVllmError(f"specx: {name}={raw!r} must not be negative")
    return value


class EngineDrafter:
    """vLLM's `SuffixDecodingCache`, drafting from a specx store (see the module docstring): a
    core.index.suffix_cache.SuffixCache over the store's global index, plus the store's writer.

    vLLM constructs it in each worker with the suffix settings of `--speculative-config`; the
    rest comes from the environment and from vLLM's current config (model, tokenizer, rank).
    `tokenizer` and `rank` are for running it outside vLLM (tests).
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, *, tokenizer: Any = None,
                 model: str | None = None, rank: int | None = None) -> None:
        from .core.index.suffix_cache import SuffixCache
        from .core.index.suffix_index import SuffixIndex
        from .core.model.load import load_tokenizer, tokenizer_fingerprint
        from .store.db import Store
        from .store.index import MAX_DEPTH, index_for
        from .store.served import ServedWriter

        path = Path(os.environ.get("SPECX_DB", "")).expanduser()
        if not str(path) or str(path) == ".":
            raise SpecxVllmError("specx: SPECX_DB is not set: name the store to draft from")
        budget = parse_bytes(os.environ.get("SPECX_INDEX_BYTES", str(DEFAULT_INDEX_BYTES)))
        record = os.environ.get("SPECX_RECORD", "1") not in ("0", "false", "no", "")
        sync_s = _env_float("SPECX_SYNC_S", 10.0)
        # told which requests finished, a stopped one waits to be resumed as long as it takes
        linger_s = _env_float("SPECX_LINGER_S", 600.0 if FINISHES["hooked"] else 2.0)
        idle_s = _env_float("SPECX_IDLE_S", 10.0)
        config = _current_vllm_config()
        if tokenizer is None:
            if config is None:
                raise SpecxVllmError("specx: no vLLM config to find the served model's tokenizer in")
            tokenizer = load_tokenizer(config.model_config.tokenizer)
        if model is None:
            model = _served_name(config) if config is not None else str(getattr(tokenizer, "name_or_path", "model"))
        if rank is None:
            rank = _tensor_parallel_rank()
        fingerprint = tokenizer_fingerprint(tokenizer)
        t0 = time.perf_counter()
        with Store(path) as store:
            known = store.db.execute("SELECT t.name, t.fingerprint FROM tokenizers t WHERE EXISTS"
                                     " (SELECT 1 FROM tokens k WHERE k.tokenizer_id = t.id)").fetchall()
            tokenizer_id = store.tokenizer_id(fingerprint)
            if known and tokenizer_id is None:
                names = ", ".join(f"{n} ({f})" for n, f in known)
                raise SpecxVllmError(f"specx: {path} holds tokens of {names}, not of the served model's tokenizer "
                                     f"({model}, {fingerprint}): `specx ingest LOGS --db {path} --model "
                                     f"{getattr(tokenizer, 'name_or_path', model)}` tokenizes them for it")
            use_global = max_cached_requests != 0
            index = index_for(store, fingerprint, MAX_DEPTH) if use_global else SuffixIndex(MAX_DEPTH)
            state = store.index_state(tokenizer_id) if tokenizer_id is not None else None
            after_rowid = state.last_token_rowid if state is not None else 0
        index.budget_bytes = budget
        index.evict(budget)
        self._incoming: collections.deque = collections.deque()  # other writers' outputs (numpy arrays)
        self.writer = None
        if record and rank == 0 and use_global:
            vocab_size = len(tokenizer)
            self.writer = ServedWriter(
                path, model, fingerprint, model, vocab_size,
                lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False),
                session_prefix=f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}/", after_rowid=after_rowid,
                on_rows=self._incoming.extend, sync_s=sync_s, max_depth=MAX_DEPTH)
        self.cache = SuffixCache(index, max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests,
                                 on_finish=self._on_finish if self.writer is not None else None, linger_s=linger_s)
        warm_up(SuffixCache)  # compile (or load) the drafting kernels now, not in the first requests
        self.path = path
        self.num_imported = 0
        self._closed = False
        # vLLM stops a request only at its next step and may kill its workers at shutdown without
        # a chance to clean up: a timer finishes (and so stores) requests once the engine goes quiet.
        self._lock = threading.Lock()  # the engine's thread and the timer share the cache
        self._idle_s = idle_s
        if self.writer is not None:
            threading.Thread(target=self._finish_quiet_requests, name="specx-idle", daemon=True).start()
        # Engines never stop their last requests, and vLLM's workers end by SystemExit: store what is
        # left at exit (multiprocessing's finalizers run in spawned and forked children alike).
        multiprocessing.util.Finalize(self, self.close, exitpriority=100)
        DRAFTERS.add(self)
        log.info("specx: drafting from %s: %d outputs, %d tokens, %.1f MB in %.2f s (rank %d, %s)", path,
                 index.num_sequences, index.num_tokens, index.nbytes / 1e6, time.perf_counter() - t0, rank,
                 "recording" if self.writer is not None else "not recording")

    # ------------------------------------------------------------ SuffixDecodingCache's interface

    @property
    def active_requests(self) -> Any:
        return self.cache.active_requests

    @property
    def cached_requests(self) -> Any:
        return self.cache.cached_requests

    @property
    def global_index(self) -> Any:
        return self.cache.global_index

    def start_request(self, req_id: Any, prompt_token_ids: Any) -> None:
        with self._lock:
            while self._incoming:  # added here, under the lock: the index is not thread-safe
                self.cache.global_index.add(self._incoming.popleft())
                self.num_imported += 1
            self.cache.start_request(req_id, prompt_token_ids)

    def add_active_response(self, req_id: Any, token_ids: Any) -> None:
        with self._lock:
            self.cache.add_active_response(req_id, token_ids)

    def stop_request(self, req_id: Any) -> None:
        with self._lock:
            self.cache.stop_request(req_id)

    def evict_cached_response(self, req_id: Any) -> None:
        with self._lock:
            self.cache.evict_cached_response(req_id)

    def speculate(self, req_id: Any, context: Any, max_spec_tokens: int | None = None, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_tree_spec: bool = False) -> Any:
        with self._lock:
            return self.cache.speculate(req_id, context, max_spec_tokens, max_spec_factor, max_spec_offset,
                                        min_token_prob, use_tree_spec)

    def flush(self) -> int:
        with self._lock:
            return self.cache.flush()

    def engine_step(self, finished: Any = ()) -> int:
        with self._lock:
            return self.cache.engine_step(finished)

    def _finish_quiet_requests(self) -> None:
        while not self._closed:
            time.sleep(min(1.0, max(self._idle_s / 4, 0.05)))
            with self._lock:
                if not self._closed:
                    self.cache.finish_idle(self._idle_s)

    def close(self) -> None:
        """Finish every request, store what is left and persist the index (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            num = self.cache.flush()
        if self.writer is not None:
            self.writer.close()
            log.info("specx: stored %d requests in %s (%d at exit), %d failed", self.writer.num_stored, self.path,
                     num, self.writer.num_failed)

    def _on_finish(self, req_id: Any, prompt: Any, output: Any) -> None:
        from .store.served import ServedRequest

        self.writer.put(ServedRequest(str(req_id), prompt, output))  # type: ignore[union-attr]


def warm_up(cache_class: Any) -> None:
    """Run each drafting kernel once on a scratch cache (numba loads compiled code on first use)."""
    scratch = cache_class()
    for req_id in ("a", "b"):
        scratch.start_request(req_id, [1, 2, 3, 1, 2])
        scratch.add_active_response(req_id, [3])
        scratch.speculate(req_id, [1, 2, 3, 1, 2, 3], max_spec_tokens=4)
        scratch.stop_request(req_id)
    scratch.flush()


def _current_vllm_config() -> Any:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def _served_name(config: Any) -> str:
    name = config.model_config.served_model_name
    return str(name[0] if isinstance(name, (list, tuple)) else name or config.model_config.model)


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return 0  # outside vLLM's distributed setup: one process
