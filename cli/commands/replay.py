"""`specx replay`: stored calls replayed, model-free with a simulated verifier, or through a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import output
from .options import BackendOpt, DbOpt, JsonOpt, ListOpt, check_drafters, existing_store, stored_calls, tenant_option
from ..stack import default_drafter
from ..home import keep_cost, specx_home


def replay_cmd(
    db: DbOpt = None,
    tokenizer: Annotated[str, typer.Option(help="Tokenizer whose stored tokens to replay (as given to ingest).",
                                           envvar="SPECX_MODEL")] = "smollm2-135m",
    model: Annotated[Optional[str], typer.Option(help="Re-run the stored prompts through this model (built-in name, "
                                                     "HF folder, .gguf file or hub id): plain decoding, transformers' "
                                                     "prompt lookup and specx, measured.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="With --model: most tokens generated per call.")] = 64,
    dtype: Annotated[str, typer.Option(help="With --model: weights dtype (auto, float32, bfloat16, float16).")] = "auto",
    backend: BackendOpt = "auto",
    drafters: Annotated[Optional[str], typer.Option("--drafter", show_default=False, help="specx's drafter(s), comma-"
                        "separated: suffix (specx), table, hybrid (default with --model: serve's; else suffix).")] = None,
    prefix_cache_tokens: Annotated[int, typer.Option(min=0, help="With --model: KV entries of past prompts each "
                                                                 "method may reuse for prompts that start the same "
                                                                 "way (0: prefill every prompt whole).")] = 8192,
    fmt: Annotated[ListOpt, typer.Option("--format", help="Only calls from logs of this format (repeatable).")] = None,
    source: Annotated[ListOpt, typer.Option(help="Only calls whose log path contains this (repeatable).")] = None,
    llm: Annotated[ListOpt, typer.Option(help="Only calls made by a model whose name contains this.")] = None,
    agent: Annotated[ListOpt, typer.Option(help="Only calls of this agent role (repeatable).")] = None,
    session: Annotated[ListOpt, typer.Option(help="Only sessions whose id contains this (repeatable).")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Replay at most this many calls.")] = None,
    tenant: Annotated[Optional[str], tenant_option("Only this tenant's calls, drafted from its history alone (with "
                                                   "--warm, also its other sessions' and the public tenant's). "
                                                   "Default: every tenant's.")] = None,
    by: Annotated[str, typer.Option(help="Group results by: format, source, model, agent or session.")] = "format",
    warm: Annotated[bool, typer.Option(help="Pre-load the outputs of sessions outside the selection into the "
                                            "global index (default: it starts empty and learns online).")] = False,
    prompt_window: Annotated[Optional[int], typer.Option(min=0, help="Prompt tokens in the request index (the last "
                                                       "N; default 4096, or 1024 with --model).")] = None,
    max_spec_tokens: Annotated[int, typer.Option(min=0, help="Most draft tokens per step.")] = 32,
    max_spec_factor: Annotated[Optional[float], typer.Option(min=0, help="Draft at most factor x match length tokens "
                                                           "(default 1, or 4 with --model, where cost-aware "
                                                           "sizing cuts what does not pay).")] = None,
    min_token_prob: Annotated[float, typer.Option(min=0, max=1, help="Drop draft nodes less likely than this.")] = 0.1,
    max_depth: Annotated[int, typer.Option(min=1, max=512, help="Longest context suffix matched.")] = 64,
    tree: Annotated[bool, typer.Option("--tree/--path", help="Draft trees (verified as trees) or single paths.")] = True,
    merge: Annotated[bool, typer.Option(help="Verify the union of the request and global indexes' best trees "
                                             "(--no-merge: only the better one).")] = True,
    baselines: Annotated[bool, typer.Option(help="Also replay prompt lookup, each index alone and the reference "
                                                 "implementation (when installed), on the same calls.")] = True,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG or SVG: tokens per step against "
                                                                     "calls replayed, and accepted lengths.")] = None,
    project: Annotated[bool, typer.Option(help="Project the speedup over plain decoding and over prompt lookup "
                                               "on each cost curve (replays again with drafts cut to what pays, "
                                               "on curves that are not flat).")] = True,
    cost_curve: Annotated[Optional[list[Path]], typer.Option(help="A cost curve file for the projection, JSON "
                                                                  "{\"1\": 1.0, \"8\": 1.3, ...} (repeatable; "
                                                                  "flat and cpu are built in).")] = None,
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
    from ..core.model.load import load_tokenizer, tokenizer_fingerprint
    from ..core.predict import methods as replay_lib
    from ..store.db import Store
    from ..store.prompts import prompt_tokens
    from ..store.selection import GROUPS, outside_sessions
    from .. import predict as predict_lib

    if by not in GROUPS:
        raise typer.BadParameter(f"must be one of {', '.join(GROUPS)}", param_hint="--by")
    if plot_file is not None and plot_file.suffix.lower() not in (".png", ".svg"):
        raise typer.BadParameter("must end in .png or .svg", param_hint="--plot")
    path = existing_store(db)
    if prompt_window is None:
        prompt_window = 4096 if model is None else 1024
    if max_spec_factor is None:
        max_spec_factor = 1.0 if model is None else 4.0
    if model is None and drafters not in (None, "suffix"):
        raise typer.BadParameter("the model-free replay drafts from the suffix index only: the successor table "
                                 "holds the model's own predictions, which only a replay with --model has",
                                 param_hint="--drafter")
    if model is not None:
        if plot_file is not None:
            raise typer.BadParameter("--plot is for the model-free replay", param_hint="--plot")
        return _replay_with_model(path, model, dtype=dtype, backend=backend, window=prompt_window,
                                  drafters=check_drafters(drafters, many=True),
                                  max_tokens=max_tokens, warm=warm, baselines=baselines, json_out=json_out,
                                  selection=dict(formats=fmt, sources=source, models=llm, agents=agent,
                                                 sessions=session, limit=limit), tenant=tenant,
                                  params={"max_spec_tokens": max_spec_tokens, "max_spec_factor": max_spec_factor,
                                          "min_token_prob": min_token_prob, "max_depth": max_depth, "tree": tree,
                                          "merge": merge, "prompt_window": prompt_window},
                                  prefix_cache_tokens=prefix_cache_tokens)
    curves = predict_lib.cost_curves(cost_curve) if project else []
    tok = load_tokenizer(tokenizer, specx_home() / "models")
    with Store(path, readonly="auto") as store:
        tokenizer_id, calls = stored_calls(store, tokenizer_fingerprint(tok), tokenizer, formats=fmt, sources=source,
                                           models=llm, agents=agent, sessions=session, limit=limit,
                                           tenants=tenants(tenant))
        output.note(f"replaying {len(calls):,} calls; rendering prompts (last {prompt_window} tokens)")
        prompts = prompt_tokens(store, tok, calls, prompt_window)
        outputs = [store.call_tokens(c.id, tokenizer_id) for c in calls]
        warm_tokens = [store.call_tokens(c.id, tokenizer_id) for c in outside_sessions(
            store, tokenizer_id, calls, tenants(tenant, warm=True))] if warm else []
    params = {"max_spec_tokens": max_spec_tokens, "max_spec_factor": max_spec_factor,
              "min_token_prob": min_token_prob, "max_depth": max_depth, "tree": tree, "merge": merge,
              "prompt_window": prompt_window, "warm_outputs": len(warm_tokens)}
    if tenant is not None:
        params["tenant"] = tenant
    methods = ["specx"]
    if baselines:
        methods += (["specx_unmerged"] if merge else []) + ["global_only", "request_only", "prompt_lookup"]
        if replay_lib.reference_available():
            methods.append("reference")
    with output.progress() as bar:
        task = bar.add_task("replay", total=len(calls) * len(methods))
        result = replay_lib.run_replay(calls, prompts, outputs, warm_tokens, params, by, methods,
                                       on_call=lambda: bar.advance(task))
    if curves:
        with output.progress() as bar:
            task = bar.add_task("projection", total=len(calls))
            result.projection = predict_lib.project_replay(calls, prompts, outputs, warm=warm_tokens, params=params,
                                                           by=by, curves=curves, result=result,
                                                           on_call=lambda: bar.advance(task))
        result.cost_curves = predict_lib.curves_json(curves)
    if plot_file is not None:
        replay_lib.plot(result, plot_file)
        output.note(f"plot: {plot_file}")
    data = result.to_json()
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


def tenants(tenant: str | None, warm: bool = False) -> list[str] | None:
    """The tenants whose calls a replay with --tenant reads (None: every tenant's): the tenant's
    (`warm`: what --warm pre-loads, the public tenant's too, as a server drafts from them).

    >>> tenants(None), tenants("team-a"), tenants("team-a", warm=True), tenants("public", warm=True)
    (None, ['team-a'], ['team-a', 'public'], ['public'])
    """
    from ..store.tenants import PUBLIC

    if tenant is None:
        return None
    return list(dict.fromkeys([tenant, PUBLIC])) if warm else [tenant]


_REPLAY_CAPTION = "higher tokens_per_step is better (1.0: no speculation); us columns: lower is better"


def _replay_with_model(path: Path, model: str, *, dtype: str, backend: str, window: int, max_tokens: int, warm: bool,
                       baselines: bool, json_out: bool, selection: dict[str, Any], params: dict[str, Any],
                       prefix_cache_tokens: int = 0, drafters: list[str], tenant: str | None = None) -> None:
    from ..core.predict import methods as replay_lib
    from ..core.predict.compare import DRAFTER_METHODS
    from ..store.db import Store
    from ..core.index.successors import SuccessorTable
    from ..store.prompts import model_prompts
    from ..store.selection import outside_sessions, select_calls
    from ..store.successors import table_key

    from ..stack import assemble, kept_table

    stack = assemble(model, backend=backend, dtype=dtype, say=output.note, check_template=False, speculation=False)
    engine, tok, cost = stack.engine, stack.tokenizer, stack.cost
    drafters = drafters or [default_drafter(engine)]  # none given: the engine's
    with Store(path, readonly="auto") as store:
        tokenizer_id = store.tokenizer_id(stack.fingerprint)
        if tokenizer_id is None:
            raise typer.BadParameter(f"the store has no tokens for {model!r}'s tokenizer: ingest with --model {model}",
                                     param_hint="--model")
        calls = select_calls(store, tokenizer_id, **selection, tenants=tenants(tenant))
        calls, prompts = model_prompts(store, tok, calls, window)
        if not calls:
            raise typer.BadParameter("no stored call with a prompt matches the selection",
                                     param_hint="--format/--source/...")
        warm_tokens = [store.call_tokens(c.id, tokenizer_id) for c in outside_sessions(
            store, tokenizer_id, calls, tenants(tenant, warm=True))] if warm else []
        # the kept successor table learned from every tenant's requests: a tenant's replay starts a new one
        kept = kept_table(store, table_key(Path(model).name, stack.fingerprint), engine.vocab_size, output.note) \
            if warm and drafters != ["suffix"] and tenant is None else None
    tables = (lambda: SuccessorTable.from_bytes(kept.to_bytes())) if kept is not None else None  # a warm copy each
    methods = ["plain", "prompt_lookup", "specx"] if baselines and engine.prompt_lookup else ["plain", "specx"]
    if baselines and not engine.prompt_lookup:
        output.note("on llama.cpp the replay compares plain decoding and specx (llama.cpp's own prompt lookup: "
                    "examples/llamacpp_bench.py)")
    shown = [m for m in methods if m != "specx"] + [DRAFTER_METHODS[d] for d in drafters]
    output.note(f"replaying {len(calls):,} calls through {model} ({', '.join(shown)}; {sum(map(len, prompts)):,} "
                f"prompt tokens, at most {max_tokens} new tokens each)")
    with output.progress() as bar:
        task = bar.add_task("replay", total=len(calls) * len(shown))
        result = replay_lib.run_model_replay(engine, tok, prompts, warm_tokens,
                                             params=params | {"warm_outputs": len(warm_tokens)}, methods=methods,
                                             max_tokens=max_tokens, cost=cost, on_call=lambda: bar.advance(task),
                                             prefix_cache_tokens=prefix_cache_tokens, drafters=drafters,
                                             table=tables)
    keep_cost(cost, output.note)
    result.model, result.backend, result.dtype = model, engine.name, engine.precision
    if result.comparison.busy:
        output.note(result.comparison.busy)
    data = result.to_json()
    if json_out:
        output.print_json(data)
        return
    keys = ["tokens_per_s", "speedup_vs_plain", "speedup_vs_prompt_lookup", "tokens", "seconds", "identical_calls",
            "tokens_per_step", "accepted_per_step"]
    output.print_table(f"replay through {model}: {len(calls)} calls, greedy", ["method"] + keys,
                       [[name] + [row.get(k) for k in keys] for name, row in data["methods"].items()],
                       caption="higher tokens_per_s and speedup are better; identical_calls should equal calls")
