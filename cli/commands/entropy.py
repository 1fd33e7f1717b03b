"""`specx entropy`: how predictable the stored outputs are, per group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import output
from .options import DbOpt, JsonOpt, ListOpt, existing_store, stored_calls, tenant_option
from ..home import specx_home
from ..predict import DEFAULT_SAMPLE_CALLS, SAMPLINGS


def entropy_cmd(
    db: DbOpt = None,
    tokenizer: Annotated[str, typer.Option(help="Tokenizer whose stored tokens to measure (as given to ingest).",
                                           envvar="SPECX_MODEL")] = "smollm2-135m",
    by: Annotated[str, typer.Option(help="Group by: format, source, model, agent or session.")] = "format",
    sample: Annotated[Optional[int], typer.Option(min=1, help="Use N outputs per group, drawn at random (the "
                                                              "SuffixDecoding paper finds ~100 enough).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for --sample, and for where --sample-calls' evenly spaced "
                                           "draws start.")] = 0,
    max_depth: Annotated[int, typer.Option(min=1, max=512, help="Deepest context (index node) counted.")] = 64,
    fmt: Annotated[ListOpt, typer.Option("--format", help="Only calls from logs of this format (repeatable).")] = None,
    source: Annotated[ListOpt, typer.Option(help="Only calls whose log path contains this (repeatable).")] = None,
    llm: Annotated[ListOpt, typer.Option(help="Only calls made by a model whose name contains this.")] = None,
    agent: Annotated[ListOpt, typer.Option(help="Only calls of this agent role (repeatable).")] = None,
    tenant: Annotated[Optional[str], tenant_option("Only this tenant's calls (its history is all the prediction "
                                                   "replays them with). Default: every tenant's.")] = None,
    predict: Annotated[bool, typer.Option(help="Also predict the tokens per step `specx replay` would measure "
                                               "(with its defaults) and the speedup, by replaying a sample of "
                                               "the calls.")] = True,
    sample_calls: Annotated[Optional[int], typer.Option(min=1, help=f"Calls the prediction replays, at most "
                                                        f"(default {DEFAULT_SAMPLE_CALLS}; each group gets at least N / "
                                                        "groups; every call of a smaller selection).")] = None,
    sampling: Annotated[str, typer.Option(help="How the prediction draws its calls: weighted (a call's chance "
                                               "grows with the square root of its output length) or calls "
                                               "(every call alike).")] = "weighted",
    cost_curve: Annotated[Optional[list[Path]], typer.Option(help="A cost curve file, JSON {\"1\": 1.0, \"8\": "
                                                                  "1.3, ...}: a pass verifying k tokens costs this "
                                                                  "relative to one (repeatable; flat and cpu are "
                                                                  "built in).")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG or SVG of the prediction's learning "
                                                                     "curve: tokens per step against the history "
                                                                     "the global index held.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """How predictable are the stored outputs? Empirical entropy per group, before any model runs.

    entropy_bits: over every context (suffix-index node) of 1 to max-depth tokens in the outputs, the
    entropy of the token that follows it, averaged weighted by the context's occurrences. Low means
    structured, repetitive output: long accepted drafts. H0..H4 are the plain order-k conditional
    entropies for reference. The entropy describes the outputs; it does not rank workloads by the
    speedup (docs/predict.md).

    The prediction (--no-predict: none) replays a sample of the calls (about 200, drawn within each
    group) with the history a full `specx replay` gives them, and estimates per group and overall the tokens per step that
    replay would measure, with a 95% interval, and the speedup over plain decoding and over prompt
    lookup per cost curve: flat (a large model on a GPU at small batch), cpu (the built-in model on
    a 2-core CPU) and --cost-curve files.

    Example: [bold]specx entropy --by agent --sample 100 --plot learning.png[/]
    Example: [bold]specx entropy --format swe-agent --sample-calls 100 --cost-curve my-gpu.json --json[/]
    """
    import numpy as np

    from ..core.model.load import load_tokenizer, tokenizer_fingerprint
    from ..core.predict.entropy import empirical_entropy
    from ..store.db import Store
    from ..store.selection import GROUPS
    from .. import predict as predict_lib

    if by not in GROUPS:
        raise typer.BadParameter(f"must be one of {', '.join(GROUPS)}", param_hint="--by")
    if sampling not in SAMPLINGS:
        raise typer.BadParameter(f"must be one of {', '.join(SAMPLINGS)}", param_hint="--sampling")
    if plot_file is not None and not predict:
        raise typer.BadParameter("the learning curve comes from the prediction: leave out --no-predict",
                                 param_hint="--plot")
    path = existing_store(db)
    curves = predict_lib.cost_curves(cost_curve) if predict else []
    tok = load_tokenizer(tokenizer, specx_home() / "models")
    rng = np.random.default_rng(seed)
    with Store(path, readonly="auto") as store:
        tokenizer_id, calls = stored_calls(store, tokenizer_fingerprint(tok), tokenizer, formats=fmt, sources=source,
                                           models=llm, agents=agent, tenants=None if tenant is None else [tenant])
        groups: dict[str, list] = {}
        for call in calls:
            groups.setdefault(call.group(by), []).append(call)
        rows = []
        everything = []
        for key, members in sorted(groups.items()):
            if sample is not None and len(members) > sample:
                members = [members[i] for i in sorted(rng.choice(len(members), size=sample, replace=False))]
            tokens = [store.call_tokens(c.id, tokenizer_id) for c in members]
            everything += tokens
            rows.append({"key": key, **_entropy_row(empirical_entropy(tokens, max_depth=max_depth), len(members))})
        overall = {"key": "overall", **_entropy_row(empirical_entropy(everything, max_depth=max_depth),
                                                    sum(r["calls"] for r in rows))}
        prediction = None
        if predict:
            n = predict_lib.sample_size(sample_calls, len(calls))
            output.note(f"predicting: replaying about {n:,} of {len(calls):,} calls (drawn within each {by}) with "
                        "their history")
            with output.progress() as bar:
                task = bar.add_task("predict", total=n)
                prediction = predict_lib.predict_selection(store, tok, tokenizer_id, calls, by=by, curves=curves,
                                                           sample_calls=sample_calls, seed=seed, sampling=sampling,
                                                           on_call=lambda: bar.advance(task),
                                                           on_sample=lambda k: bar.update(task, total=k))
            for row in rows:
                row.update(prediction["groups"][row["key"]])
            overall.update(prediction["overall"])
    if plot_file is not None and prediction is not None:
        predict_lib.plot(prediction, by, plot_file)
        output.note(f"plot: {plot_file}")
    if json_out:
        extra = {"prediction": prediction["sample"] | {"learning_curve": prediction["learning_curve"],
                                                       "not_covered": NOT_COVERED}} if prediction else {}
        output.print_json({"by": by, "max_depth": max_depth, "sample": sample, "groups": rows, "overall": overall}
                          | extra)
        return
    columns = ["calls", "tokens", "entropy_bits", "H0", "H1", "H2", "H3", "H4"]
    table = [[r["key"], r["calls"], r["tokens"], r["entropy_bits"], *r["order_bits"]] for r in rows + [overall]]
    caption = "lower bits: more predictable outputs (a description, not a predicted speedup)"
    if prediction:
        columns += ["sample_calls", "tokens/step", "95% interval"]
        columns += [f"{c.name}: x plain / x prompt lookup" for c in curves]
        for line, r in zip(table, rows + [overall]):
            line += [r["sample_calls"], r["predicted_tokens_per_step"], _interval(r)]
            line += [predict_lib.speedups_cell(r["predicted_speedup"][c.name]) for c in curves]
        caption += ("; tokens/step: predicted `specx replay` figure (higher is better), 95% interval; x: predicted"
                    " speedup on that cost curve (higher is better); not covered: " + NOT_COVERED)
    output.print_table(f"empirical entropy by {by} (bits; contexts of 1-{max_depth} tokens)", [by] + columns, table,
                       caption=caption)


# What the prediction cannot see: it replays the logs' outputs through the suffix drafter, and no log
# holds the model's own next-token distribution that --drafter table|hybrid drafts from.
NOT_COVERED = ("the successor table of --drafter table and hybrid (the model's own predictions, which no log "
               "holds): the figures are the suffix drafter's; the hybrid adds to them where the model repeats "
               "itself (docs/design.md, \"The successor table\")")


def _interval(row: dict) -> str:
    low, high = row["predicted_tokens_per_step_low"], row["predicted_tokens_per_step_high"]
    if low is None:
        return "-"
    return f"{low:.2f}-{high:.2f}" if low != high else "exact"


def _entropy_row(result, calls: int) -> dict:
    return {"calls": calls, "tokens": result.num_tokens, "entropy_bits": result.entropy_bits,
            "order_bits": result.order_bits, "contexts": result.num_contexts}
