"""The options of `specx replay` alone (typer's annotations; commands/replay.py lists them in order,
options.py holds those it shares with other commands, cli/replays.py checks them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .options import ListOpt, tenant_option

TokenizerOpt = Annotated[str, typer.Option(help="Tokenizer whose stored tokens to replay (as given to ingest).",
                                           envvar="SPECX_MODEL")]
ReplayModelOpt = Annotated[Optional[str], typer.Option(help="Re-run the stored prompts through this model (built-in "
                                                       "name, HF folder, .gguf file or hub id): plain decoding, "
                                                       "transformers' prompt lookup and specx, measured.")]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="With --model: most tokens generated per call.")]
ReplayDtypeOpt = Annotated[str, typer.Option(help="With --model: weights dtype (auto, float32, bfloat16, float16).")]
DraftersOpt = Annotated[Optional[str], typer.Option("--drafter", show_default=False, help="specx's drafter(s), comma-"
                        "separated: suffix (specx), table, hybrid (default with --model: serve's; else suffix).")]
PrefixCacheTokensOpt = Annotated[int, typer.Option(min=0, help="With --model: KV entries of past prompts each "
                                                               "method may reuse for prompts that start the same "
                                                               "way (0: prefill every prompt whole).")]
SessionsOpt = Annotated[ListOpt, typer.Option(help="Only sessions whose id contains this (repeatable).")]
LimitOpt = Annotated[Optional[int], typer.Option(min=1, help="Replay at most this many calls.")]
TenantOpt = Annotated[Optional[str], tenant_option("Only this tenant's calls, drafted from its history alone (with "
                                                   "--warm, also its other sessions' and the public tenant's). "
                                                   "Default: every tenant's.")]
ByOpt = Annotated[str, typer.Option(help="Group results by: format, source, model, agent or session.")]
WarmOpt = Annotated[bool, typer.Option(help="Pre-load the outputs of sessions outside the selection into the "
                                            "global index (default: it starts empty and learns online).")]
PromptWindowOpt = Annotated[Optional[int], typer.Option(min=0, help="Prompt tokens in the request index (the last "
                                                        "N; default 4096, or 1024 with --model).")]
MaxSpecFactorOpt = Annotated[Optional[float], typer.Option(min=0, help="Draft at most factor x match length tokens "
                                                           "(default 1, or 4 with --model, where cost-aware "
                                                           "sizing cuts what does not pay).")]
MinTokenProbOpt = Annotated[float, typer.Option(min=0, max=1, help="Drop draft nodes less likely than this.")]
MaxDepthOpt = Annotated[int, typer.Option(min=1, max=512, help="Longest context suffix matched.")]
TreeOpt = Annotated[bool, typer.Option("--tree/--path", help="Draft trees (verified as trees) or single paths.")]
MergeOpt = Annotated[bool, typer.Option(help="Verify the union of the request and global indexes' best trees "
                                             "(--no-merge: only the better one).")]
BaselinesOpt = Annotated[bool, typer.Option(help="Also replay prompt lookup, each index alone and the reference "
                                                 "implementation (when installed), on the same calls.")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG or SVG: tokens per step against "
                                                                "calls replayed, and accepted lengths.")]
ProjectOpt = Annotated[bool, typer.Option(help="Project the speedup over plain decoding and over prompt lookup "
                                               "on each cost curve (replays again with drafts cut to what pays, "
                                               "on curves that are not flat).")]
CostCurveOpt = Annotated[Optional[list[Path]], typer.Option(help="A cost curve file for the projection, JSON "
                                                                 "{\"1\": 1.0, \"8\": 1.3, ...} (repeatable; "
                                                                 "flat and cpu are built in).")]
