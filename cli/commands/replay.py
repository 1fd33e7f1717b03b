"""`specx replay`: stored calls replayed, model-free with a simulated verifier, or through a model
(the replays: cli/replays.py; the options: replay_options.py)."""

from __future__ import annotations

from typing import Any

import typer

from .. import output
from .options import (AgentsOpt, BackendOpt, DbOpt, FormatsOpt, JsonOpt, LlmsOpt, MaxSpecTokensOpt, SourcesOpt,
                      check_drafters, existing_store, option_errors)
from .replay_options import (BaselinesOpt, ByOpt, CostCurveOpt, DraftersOpt, LimitOpt, MaxDepthOpt, MaxSpecFactorOpt,
                             MaxTokensOpt, MergeOpt, MinTokenProbOpt, PlotOpt, PrefixCacheTokensOpt, ProjectOpt,
                             PromptWindowOpt, ReplayDtypeOpt, ReplayModelOpt, SessionsOpt, TenantOpt, TokenizerOpt,
                             TreeOpt, WarmOpt)


def replay_cmd(
    db: DbOpt = None,
    tokenizer: TokenizerOpt = "smollm2-135m",
    model: ReplayModelOpt = None,
    max_tokens: MaxTokensOpt = 64,
    dtype: ReplayDtypeOpt = "auto",
    backend: BackendOpt = "auto",
    drafters: DraftersOpt = None,
    prefix_cache_tokens: PrefixCacheTokensOpt = 8192,
    fmt: FormatsOpt = None,
    source: SourcesOpt = None,
    llm: LlmsOpt = None,
    agent: AgentsOpt = None,
    session: SessionsOpt = None,
    limit: LimitOpt = None,
    tenant: TenantOpt = None,
    by: ByOpt = "format",
    warm: WarmOpt = False,
    prompt_window: PromptWindowOpt = None,
    max_spec_tokens: MaxSpecTokensOpt = 32,
    max_spec_factor: MaxSpecFactorOpt = None,
    min_token_prob: MinTokenProbOpt = 0.1,
    max_depth: MaxDepthOpt = 64,
    tree: TreeOpt = True,
    merge: MergeOpt = True,
    baselines: BaselinesOpt = True,
    plot_file: PlotOpt = None,
    project: ProjectOpt = True,
    cost_curve: CostCurveOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay stored calls without a model: how many tokens per verification step would speculation give?

    Each recorded output is replayed as if the model wrote it (a simulated verifier): draft, accept
    the longest draft path equal to the recording, add one bonus token, repeat. The request index
    holds the call's prompt and output so far; the global index holds the outputs of the calls
    already replayed. Every output must be rebuilt exactly. The projected speedup turns that into
    time on a cost curve (the relative cost of verifying k tokens at once): flat (a large model on
    a GPU at small batch), cpu (the built-in model on a 2-core CPU), or --cost-curve files; `specx
    entropy` predicts the same figures from a sample of the calls.

    With --model, the stored prompts go through the model instead: plain greedy decoding,
    transformers' prompt lookup and specx take turns call by call, each output of specx entering
    the global index at once, as when serving (--drafter: each drafter a method of its own; the
    table and the hybrid learn the model's successor table from their passes, warm from the store's). Reported: tokens/s, speedups, and the calls whose
    output is identical to plain decoding's.

    With --tenant, only that tenant's calls are replayed, and the global index holds its outputs
    alone (with --warm, also its other sessions' and the public tenant's), as a server with
    tenants drafts a tenant's requests: never from another tenant's history.

    Example: [bold]specx replay --format swe-agent --plot swe.png[/]
    Example: [bold]specx replay --model smollm2-135m --format text2sql-multiagent --limit 20[/]
    Example: [bold]specx replay --model smollm2-135m --source multi-agent --limit 24 --drafter suffix,hybrid[/]
    """
    from .. import predict as predict_lib, replays
    from ..store.selection import GROUPS

    if by not in GROUPS:
        raise typer.BadParameter(f"must be one of {', '.join(GROUPS)}", param_hint="--by")
    if plot_file is not None and plot_file.suffix.lower() not in (".png", ".svg"):
        raise typer.BadParameter("must end in .png or .svg", param_hint="--plot")
    path = existing_store(db)
    selection = dict(formats=fmt, sources=source, models=llm, agents=agent, sessions=session, limit=limit)
    with option_errors():
        params = replays.replay_params(model, drafters, plot_file, max_spec_tokens=max_spec_tokens,
                                       max_spec_factor=max_spec_factor, min_token_prob=min_token_prob,
                                       max_depth=max_depth, tree=tree, merge=merge, prompt_window=prompt_window)
        if model is not None:
            through = replays.replay_through_model(
                path, model, dtype=dtype, backend=backend, drafters=check_drafters(drafters, many=True),
                max_tokens=max_tokens, warm=warm, baselines=baselines, selection=selection, tenant=tenant,
                params=params, prefix_cache_tokens=prefix_cache_tokens)
            return _print_model_replay(through.to_json(), model, json_out)
        curves = predict_lib.cost_curves(cost_curve) if project else []
        result = replays.replay_stored(path, tokenizer, selection, tenant=tenant, warm=warm, params=params, by=by,
                                       baselines=baselines, curves=curves, plot=plot_file)
    _print_replay(result.to_json(), by=by, tree=tree, curves=curves, json_out=json_out)


_REPLAY_CAPTION = "higher tokens_per_step is better (1.0: no speculation); us columns: lower is better"


def _print_replay(data: dict[str, Any], *, by: str, tree: bool, curves: list[Any], json_out: bool) -> None:
    """The model-free replay: by group, the methods side by side, the projected speedups."""
    from .. import predict as predict_lib

    if json_out:
        output.print_json(data)
        return
    keys = ["calls", "output_tokens", "steps", "tokens_per_step", "accepted_per_step", "acceptance_rate",
            "mean_draft_size", "draft_us_per_token", "update_us_per_token"]
    output.print_table(f"replay by {by} (specx, {'tree' if tree else 'path'} drafts)", [by] + keys,
                       [[g["key"]] + [g[k] for k in keys] for g in data["groups"]]
                       + [["overall"] + [data["overall"][k] for k in keys]], caption=_REPLAY_CAPTION)
    if data["baselines"]:
        rows = [["specx"] + [data["overall"][k] for k in keys]]
        rows += [[name] + [stats[k] for k in keys] for name, stats in data["baselines"].items()]
        output.print_table("methods on the same calls", ["method"] + keys, rows, caption=_REPLAY_CAPTION)
    if curves:
        output.print_table(f"projected speedup of specx by {by} (cost curve: x plain decoding / x prompt lookup)",
                           [by] + [c.name for c in curves],
                           [[row["key"]] + [predict_lib.speedups_cell(row["projected_speedup"][c.name]) for c in curves]
                            for row in data["groups"] + [{"key": "overall"} | data]],
                           caption="higher is better; drafts cut to what pays on curves that are not flat "
                                   "(docs/predict.md)")


def _print_model_replay(data: dict[str, Any], model: str, json_out: bool) -> None:
    """The replay through a model: each method's speed and the calls identical to plain decoding's."""
    if json_out:
        output.print_json(data)
        return
    keys = ["tokens_per_s", "speedup_vs_plain", "speedup_vs_prompt_lookup", "tokens", "seconds", "identical_calls",
            "tokens_per_step", "accepted_per_step"]
    output.print_table(f"replay through {model}: {data['calls']} calls, greedy", ["method"] + keys,
                       [[name] + [row.get(k) for k in keys] for name, row in data["methods"].items()],
                       caption="higher tokens_per_s and speedup are better; identical_calls should equal calls")
