"""The replays behind `specx replay`: stored calls replayed model-free, with a simulated verifier
(core.predict.methods.run_replay, projected on cost curves by predict.py), or through a model
(run_model_replay, on the stack of stack.py). The command (commands/replay.py) parses and prints;
an option found wrong here is a SettingError naming it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import output
from .home import keep_cost, specx_home
from .stack import SettingError

if TYPE_CHECKING:
    from .core.predict.curves import CostCurve
    from .core.predict.methods import MethodReplays, ModelReplay


def replay_params(model: str | None, drafters: str | None, plot: Path | None, *, max_spec_tokens: int,
                  max_spec_factor: float | None, min_token_prob: float, max_depth: int, tree: bool, merge: bool,
                  prompt_window: int | None) -> dict[str, Any]:
    """The drafting settings of a replay, model-free or through `model` (unless given: a prompt window
    of 4096 tokens and a factor of 1 model-free, 1024 and 4 with a model), or SettingError for
    --drafter and --plot where the replay has no use for them."""
    if prompt_window is None:
        prompt_window = 4096 if model is None else 1024
    if max_spec_factor is None:
        max_spec_factor = 1.0 if model is None else 4.0
    if model is None and drafters not in (None, "suffix"):
        raise SettingError("--drafter", "the model-free replay drafts from the suffix index only: the successor "
                           "table holds the model's own predictions, which only a replay with --model has")
    if model is not None and plot is not None:
        raise SettingError("--plot", "--plot is for the model-free replay")
    return {"max_spec_tokens": max_spec_tokens, "max_spec_factor": max_spec_factor, "min_token_prob": min_token_prob,
            "max_depth": max_depth, "tree": tree, "merge": merge, "prompt_window": prompt_window}


def tenants(tenant: str | None, warm: bool = False) -> list[str] | None:
    """The tenants whose calls a replay with --tenant reads (None: every tenant's): the tenant's
    (`warm`: what --warm pre-loads, the public tenant's too, as a server drafts from them).

    >>> tenants(None), tenants("team-a"), tenants("team-a", warm=True), tenants("public", warm=True)
    (None, ['team-a'], ['team-a', 'public'], ['public'])
    """
    from .store.tenants import PUBLIC

    if tenant is None:
        return None
    return list(dict.fromkeys([tenant, PUBLIC])) if warm else [tenant]


def replay_stored(path: Path, tokenizer: str, selection: dict[str, Any], *, tenant: str | None, warm: bool,
                  params: dict[str, Any], by: str, baselines: bool, curves: list[CostCurve],
                  plot: Path | None) -> MethodReplays:
    """The calls `selection` picks (store.selection.select_calls' keywords; `tenant`: its calls
    alone) in the store at `path`, replayed model-free from `tokenizer`'s stored tokens, grouped
    `by`: specx, and with `baselines` each index alone, prompt lookup and the reference (when
    installed); projected on `curves`; plotted to `plot`."""
    from .core.model.load import load_tokenizer, tokenizer_fingerprint
    from .core.predict import methods as replay_lib
    from .store.db import Store
    from .store.prompts import prompt_tokens
    from .store.selection import outside_sessions
    from . import predict as predict_lib

    window = params["prompt_window"]
    tok = load_tokenizer(tokenizer, specx_home() / "models")
    with Store(path, readonly="auto") as store:
        tokenizer_id, calls = predict_lib.stored_calls(store, tokenizer_fingerprint(tok), tokenizer, **selection,
                                                       tenants=tenants(tenant))
        output.note(f"replaying {len(calls):,} calls; rendering prompts (last {window} tokens)")
        prompts = prompt_tokens(store, tok, calls, window)
        outputs = [store.call_tokens(c.id, tokenizer_id) for c in calls]
        warm_tokens = [store.call_tokens(c.id, tokenizer_id) for c in outside_sessions(
            store, tokenizer_id, calls, tenants(tenant, warm=True))] if warm else []
    params = params | {"warm_outputs": len(warm_tokens)}
    if tenant is not None:
        params["tenant"] = tenant
    methods = ["specx"]
    if baselines:
        methods += (["specx_unmerged"] if params["merge"] else []) + ["global_only", "request_only", "prompt_lookup"]
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
    if plot is not None:
        replay_lib.plot(result, plot)
        output.note(f"plot: {plot}")
    return result


def replay_through_model(path: Path, model: str, *, dtype: str, backend: str, drafters: list[str], max_tokens: int,
                         warm: bool, baselines: bool, selection: dict[str, Any], tenant: str | None,
                         params: dict[str, Any], prefix_cache_tokens: int = 0) -> ModelReplay:
    """The prompts of the calls `selection` picks (as replay_stored's), through `model` on `backend`:
    plain decoding, prompt lookup (where the engine has it, with `baselines`) and specx with each of
    `drafters` (none: the engine's default), at most `max_tokens` new tokens each; `warm`: the other
    sessions' outputs, and the store's successor table, pre-loaded. SettingError (--model) when the
    store has no tokens for the model's tokenizer, (--format/--source/...) when no call matches."""
    from .core.predict import methods as replay_lib
    from .core.predict.compare import DRAFTER_METHODS
    from .store.db import Store
    from .core.index.successors import SuccessorTable
    from .store.prompts import model_prompts
    from .store.selection import outside_sessions, select_calls
    from .store.successors import table_key

    from .stack import assemble, default_drafter, kept_table

    window = params["prompt_window"]
    stack = assemble(model, backend=backend, dtype=dtype, say=output.note, check_template=False, speculation=False)
    engine, tok, cost = stack.engine, stack.tokenizer, stack.cost
    drafters = drafters or [default_drafter(engine)]  # none given: the engine's
    with Store(path, readonly="auto") as store:
        tokenizer_id = store.tokenizer_id(stack.fingerprint)
        if tokenizer_id is None:
            raise SettingError("--model", f"the store has no tokens for {model!r}'s tokenizer: ingest with "
                                          f"--model {model}")
        calls = select_calls(store, tokenizer_id, **selection, tenants=tenants(tenant))
        calls, prompts = model_prompts(store, tok, calls, window)
        if not calls:
            raise SettingError("--format/--source/...", "no stored call with a prompt matches the selection")
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
    return result
