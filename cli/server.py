"""The server `specx serve` runs, assembled from its settings: the HTTP API (http/app.py) answering
503 loading while a thread loads the stack (stack.assemble), follows the store (live.py) and starts
the worker (core/serve/worker.py); then uvicorn until a signal. The command (commands/serve.py)
parses the options; serve_settings checks them and assembles the ServeSettings run_server takes."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .home import keep_cost
from .stack import SettingError


@dataclass(frozen=True)
class ServeSettings:
    """What `specx serve` was asked for, checked (serve_settings; commands/serve_options.py says what each is)."""

    model: str
    dtype: str
    backend: str
    db: Path
    host: str
    port: int
    api_key: str | None
    tenants: dict[str, str]
    tenant_tokens: int
    shaped: bool
    stream_interval: float | None
    show_speculation: bool
    names: list[str]
    speculation: bool
    drafter: str | None
    max_queue: int
    max_batch: int | None
    max_spec_tokens: int
    max_spec_factor: float
    cost_aware: bool
    kv_bytes: int
    prefix_cache_tokens: int | None
    max_model_len: int | None
    chat_template: str | None
    allowed_origins: list[str] | None
    tool_call_parser: str | None
    keys_on_command_line: bool = False


def serve_settings(*, model: str, dtype: str, backend: str, db: Path, host: str, port: int, api_key: str | None,
                   engine: str, drafter: str | None, tenant: list[str] | None, tenant_file: Path | None,
                   tenant_tokens: int, shape_stream: bool | None, stream_interval: float | None,
                   show_speculation: bool | None, served_model_name: list[str] | None, speculation: bool,
                   max_queue: int, max_batch: int | None, max_spec_tokens: int, max_spec_factor: float,
                   cost_aware: bool, kv_memory: str | None, prefix_cache_tokens: int | None,
                   max_model_len: int | None, chat_template: str | None, allowed_origins: list[str] | None,
                   tool_call_parser: str | None) -> ServeSettings:
    """`specx serve`'s options (commands/serve_options.py says what each is; `engine` and `drafter`
    already checked to be known) checked against each other and assembled, or SettingError naming
    the first wrong one: the tenants of --tenant and --tenant-file (each key its own, none the
    operator's `api_key`), the bytes of --kv-memory (default: stack.default_kv_memory), and what
    tenants and vLLM rule out.
    Defaults that hang on the tenants: a shaped stream and hidden speculation figures with tenants,
    the suffix drafter for them; the names clients use default to the model's."""
    from .core.model.prefix_cache import parse_bytes
    from .core.serve.tool_calls import PARSERS
    from .http.auth import parse_tenants, read_tenant_file
    from .stack import default_kv_memory

    if drafter not in (None, "suffix") and engine == "vllm":
        raise SettingError("--drafter", "inside vLLM specx drafts from its suffix index only (the successor table "
                                        "learns from the logits, which vLLM keeps to itself)")
    try:
        kv_bytes = parse_bytes(kv_memory) if kv_memory is not None else default_kv_memory()
    except ValueError as exc:
        raise SettingError("--kv-memory", str(exc)) from None
    try:
        from_file = read_tenant_file(tenant_file) if tenant_file is not None else []
    except ValueError as exc:
        raise SettingError("--tenant-file", str(exc)) from None
    try:
        tenants = parse_tenants([*(tenant or []), *from_file], api_key)
    except ValueError as exc:
        raise SettingError("--tenant", str(exc)) from None
    if tenants and stream_interval is not None and stream_interval <= 0:
        raise SettingError("--stream-interval", "with tenants the stream is paced (0 would send each step's tokens "
                           "as they come, and the gaps would show which came from another's history): give a pace "
                           "in ms, or leave it to the learned one")
    if tenants and engine == "vllm":
        raise SettingError("--tenant", "tenants are specx's own server's (vLLM's drafter reads one store)")
    if tenants and drafter not in (None, "suffix"):
        raise SettingError("--drafter", "with tenants specx drafts from the suffix index only: the successor table "
                           "learns from every request's logits and would carry one tenant's text into another's "
                           "drafts")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise SettingError("--tool-call-parser", f"must be one of {', '.join(PARSERS)}")
    return ServeSettings(
        model=model, dtype=dtype, backend=backend, db=db, host=host, port=port, api_key=api_key, tenants=tenants,
        tenant_tokens=tenant_tokens, shaped=shape_stream if shape_stream is not None else bool(tenants),
        stream_interval=stream_interval,
        show_speculation=show_speculation if show_speculation is not None else not tenants,
        names=served_model_name or [model], speculation=speculation, drafter=drafter or ("suffix" if tenants else None),
        max_queue=max_queue, max_batch=max_batch, max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor,
        cost_aware=cost_aware, kv_bytes=kv_bytes, prefix_cache_tokens=prefix_cache_tokens,
        max_model_len=max_model_len, chat_template=chat_template, allowed_origins=allowed_origins,
        tool_call_parser=tool_call_parser,
        keys_on_command_line=bool(tenant) and not os.environ.get("SPECX_TENANTS"))


def run_server(s: ServeSettings) -> None:
    """Serve until stopped (a signal): the port answers at once, 503 loading until the stack is ready.
    A failure while loading stops the server and is raised here (SettingError for a setting)."""
    import uvicorn

    from .core.decode.grammar import Vocabulary
    from .core.serve.batch import default_max_batch
    from .core.serve.metrics import Metrics
    from .core.serve.worker import Worker
    from .store.served import ServedRecorder

    from .stack import assemble
    from .backends import trial_possible
    from .http.app import Api
    from .http.corpus import Corpora
    from .live import live_store, stream_pace

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s specx: %(message)s", "%H:%M:%S"))
    log = logging.getLogger("specx.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if s.keys_on_command_line:
        log.info("tenant keys came on the command line: every user of this machine sees them in the process list "
                 "(use --tenant-file or SPECX_TENANTS)")

    _check_address(s.host, s.port)  # before anything loads: a taken port is a quick, clear error
    if not _large_frees_to_the_system():
        log.info("this C library keeps its own malloc thresholds (not glibc): freed KV may stay resident")
    names = s.names
    metrics = Metrics()
    tenants, model, path = s.tenants, s.model, s.db
    api = Api(metrics, names, s.api_key, s.allowed_origins, s.tool_call_parser, tenants=tenants,
              show_speculation=s.show_speculation)
    api.corpora = Corpora(api, path, s.tenant_tokens)
    failed: list[BaseException] = []

    def load() -> None:
        """The model and the index, on a thread while the port answers 503 loading."""
        try:
            api.stage = f"loading {model}"
            log.info("%s (the first start converts a GGUF, ~30 s) ...", api.stage)
            stack = assemble(model, backend=s.backend, dtype=s.dtype, say=log.info, chat_template=s.chat_template,
                             db=None if tenants else path, create_store=True, speculation=s.speculation,
                             cost_aware=s.speculation and s.cost_aware, max_spec_tokens=s.max_spec_tokens,
                             max_spec_factor=s.max_spec_factor, prefix_cache_tokens=s.prefix_cache_tokens or 0,
                             kv_memory=None if s.prefix_cache_tokens is not None else s.kv_bytes,
                             drafter=s.drafter, context=s.max_model_len,
                             stage=lambda what: setattr(api, "stage", what))
            api.stage = "the tenants' indexes" if tenants else "following the store"
            scopes, watcher = live_store(stack, path, list(tenants), log.info)
            api.corpora.start(stack.fingerprint, watcher)
            if s.shaped:  # set before the worker answers anything (until ready, every request gets 503)
                api.pace = stream_pace(stack, s.stream_interval, at_least_plain=bool(tenants))
            log.info("stream: %s; speculation figures %s to clients", "shaped (one token per event, %s)" % (
                f"{s.stream_interval:g} ms apart" if s.stream_interval is not None else "slots a plain step's mean time apart and spreading, drafts only ahead of them")
                if s.shaped else "one event per verification step (not shaped)",
                "shown" if api.show_speculation else "hidden")
            context_length = stack.engine.context_length
            if s.max_model_len is not None and s.max_model_len > context_length:
                raise SettingError("--max-model-len", f"{s.max_model_len} is longer than the model's context "
                                                     f"({context_length} tokens)")
            api.stage = "the grammar vocabulary"  # response_format and tool_choice decode under grammars
            tok, cost = stack.tokenizer, stack.cost
            vocabulary = Vocabulary(tok, stack.engine.vocab_size, tok.eos_token_id)
            recorder = ServedRecorder(path, model, stack.fingerprint, len(tok), s.speculation,
                                      successors=stack.successors, successors_key=stack.successors_key)
            longest = min(s.max_model_len or context_length, context_length)
            batch = s.max_batch or default_max_batch(stack.engine, longest)
            worker = Worker(stack, max_queue=s.max_queue, max_batch=batch, metrics=metrics, recorder=recorder,
                            vocabulary=vocabulary,
                            save_cost=(lambda: keep_cost(cost, log.info)) if cost is not None else None,
                            scopes=scopes, debug=bool(os.environ.get("SPECX_DEBUG")))
            log.info("batching: %s", f"up to {worker.max_batch} requests share each forward pass" if worker.batched
                     else f"off (one request at a time: {stack.engine.name} passes are not batched)"
                     if batch > 1 else "off (--max-batch 1)")

            def announce() -> None:
                tokenizers = api.tokenizers
                log.info("tool calls: %s format%s", tokenizers.tool_parser, "" if tokenizers.renders_tools else
                         " (the chat template ignores tools: their schemas go into the system prompt)")
                log.info("ready: serving %s at http://%s:%d/v1 (speculation %s; global index %s tokens; store %s)",
                         ", ".join(names), s.host, s.port, "on" if s.speculation else "off",
                         f"{worker.index_tokens:,}", path)

            api.ready(worker, longest, announce)
            if s.speculation and s.backend == "auto" and trial_possible(model):
                threading.Thread(target=_engine_trials, args=(model, path, stack.engine.name, metrics, log),
                                 name="specx-engine-trial", daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - reported after the server stops, as main reports it
            failed.append(exc)
            log.error("could not start: %s", exc)
            server.should_exit = True

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # At the signal, not after uvicorn's graceful wait: the request being decoded ends at its
            # next step with an error event and [DONE], instead of being cut when the wait runs out.
            log.info("shutting down: no new requests; ending the one in flight, then persisting the index")
            if api.worker is not None:
                api.worker.shutdown_begins()
            super().handle_exit(sig, frame)

    if s.api_key is None and s.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", s.host)
    server = Server(uvicorn.Config(api.app(), host=s.host, port=s.port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10))
    log.info("listening on http://%s:%d (GET /health says 503 loading until the model is ready)", s.host, s.port)
    threading.Thread(target=load, name="specx-load", daemon=True).start()
    try:  # the app's lifespan stops the worker at shutdown and persists the index
        server.run()
    finally:
        if api.worker is not None:
            api.worker.stop()  # when uvicorn never started the app (e.g. the port is taken)
    if failed:
        raise failed[0]


def _engine_trials(model: str, db: Path, engine: str, metrics: Any, log: logging.Logger) -> None:
    """Which engine runs specx fastest here: `specx engines` in a child process at low priority, when
    no choice was made on this machine, and again once if the served workload's tokens per step
    move far from the trial's (the evidence changed). The choice is kept for the next start."""
    from .core.predict.engines import Choice

    from .core.kept_schema import printable

    from .backends import REVISIT_MIN_STEPS, REVISIT_RATIO, engine_names, kept_choice_for, start_trial

    def run(why: str) -> Choice | None:
        log.info("engine trial: %s: measuring specx on each engine in a background process (niced); the "
                 "choice is kept for the next start", why)
        child = start_trial(model, db)
        out, err = child.communicate()
        try:
            data = json.loads(out)
            choice = Choice.from_json(data["choice"], engine_names())
        except (ValueError, KeyError, TypeError):
            log.warning("engine trial failed (exit %s): %s", child.returncode,
                        printable((err.strip().splitlines() or ["no output"])[-1], 300))
            return None
        if data.get("kept") is False:  # other processes took the cores: the next start measures again
            log.warning("engine trial: disturbed (other processes held %.0f%% of the cores), not kept",
                        100 * (data.get("others_cpu_share") or 0))
            return None
        log.info("engine trial: %s%s", choice.line(), "" if choice.engine == engine else
                 f"; this server runs on {engine}: the next start runs on {choice.engine}")
        return choice

    choice = kept_choice_for(model)
    if choice is None:
        choice = run("no engine choice was measured on this machine")
        if choice is None:
            return
    while True:  # the evidence: the served requests' steps (a daemon thread: it ends with the server)
        time.sleep(30)
        steps, live = metrics.steps_since_start()
        if steps >= REVISIT_MIN_STEPS and choice.tokens_per_step > 0:
            ratio = live / choice.tokens_per_step
            if not 1 / REVISIT_RATIO <= ratio <= REVISIT_RATIO:
                run(f"the served requests write {live:.2f} tokens per step against {choice.tokens_per_step:.2f} "
                    f"in the trial")
                return


MMAP_THRESHOLD = 1 << 20  # bytes: blocks from here up are mapped on their own pages


def _large_frees_to_the_system() -> bool:
    """Have malloc map every block of MMAP_THRESHOLD bytes or more on pages of its own, unmapped when
    freed (glibc's mallopt; False where the C library has none). By default glibc raises that
    threshold to the size of each such block freed (up to 32 MB), so a server's KV caches and the
    passes' scratch, which grow with the conversations, come from the heap arenas after a while, and
    memory freed there stays the process's: four agents' conversations on the 1B shape at 24,000
    tokens peaked 2.3 GB over their kept KV. A fixed threshold also turns that raising off."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(-3, MMAP_THRESHOLD) == 1  # -3: M_MMAP_THRESHOLD (malloc.h); 1: done


def _check_address(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
