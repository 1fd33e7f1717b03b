"""`specx entropy`: how predictable the stored outputs are, per group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import output
from .options import (AgentsOpt, DbOpt, FormatsOpt, JsonOpt, LlmsOpt, SourcesOpt, existing_store, option_errors,
                      tenant_option)
from ..predict import DEFAULT_SAMPLE_CALLS, SAMPLINGS

TokenizerOpt = Annotated[str, typer.Option(help="Tokenizer whose stored tokens to measure (as given to ingest).",
                                           envvar="SPECX_MODEL")]
ByOpt = Annotated[str, typer.Option(help="Group by: format, source, model, agent or session.")]
SampleOpt = Annotated[Optional[int], typer.Option(min=1, help="Use N outputs per group, drawn at random (the "
                                                              "SuffixDecoding paper finds ~100 enough).")]
SeedOpt = Annotated[int, typer.Option(help="Seed for --sample, and for where --sample-calls' evenly spaced "
                                           "draws start.")]
MaxDepthOpt = Annotated[int, typer.Option(min=1, max=512, help="Deepest context (index node) counted.")]
TenantOpt = Annotated[Optional[str], tenant_option("Only this tenant's calls (its history is all the prediction "
                                                   "replays them with). Default: every tenant's.")]
PredictOpt = Annotated[bool, typer.Option(help="Also predict the tokens per step `specx replay` would measure "
                                               "(with its defaults) and the speedup, by replaying a sample of "
                                               "the calls.")]
SampleCallsOpt = Annotated[Optional[int], typer.Option(min=1, help=f"Calls the prediction replays, at most "
                                                       f"(default {DEFAULT_SAMPLE_CALLS}; each group gets at least N / "
                                                       "groups; every call of a smaller selection).")]
SamplingOpt = Annotated[str, typer.Option(help="How the prediction draws its calls: weighted (a call's chance "
                                               "grows with the square root of its output length) or calls "
                                               "(every call alike).")]
CostCurveOpt = Annotated[Optional[list[Path]], typer.Option(help="A cost curve file, JSON {\"1\": 1.0, \"8\": "
                                                                 "1.3, ...}: a pass verifying k tokens costs this "
                                                                 "relative to one (repeatable; flat and cpu are "
                                                                 "built in).")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG or SVG of the prediction's learning "
                                                                "curve: tokens per step against the history "
                                                                "the global index held.")]


def entropy_cmd(
    db: DbOpt = None,
    tokenizer: TokenizerOpt = "smollm2-135m",
    by: ByOpt = "format",
    sample: SampleOpt = None,
    seed: SeedOpt = 0,
    max_depth: MaxDepthOpt = 64,
    fmt: FormatsOpt = None,
    source: SourcesOpt = None,
    llm: LlmsOpt = None,
    agent: AgentsOpt = None,
    tenant: TenantOpt = None,
    predict: PredictOpt = True,
    sample_calls: SampleCallsOpt = None,
    sampling: SamplingOpt = "weighted",
    cost_curve: CostCurveOpt = None,
    plot_file: PlotOpt = None,
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
    from .. import predict as predict_lib
    from ..store.selection import GROUPS

    if by not in GROUPS:
        raise typer.BadParameter(f"must be one of {', '.join(GROUPS)}", param_hint="--by")
    if sampling not in SAMPLINGS:
        raise typer.BadParameter(f"must be one of {', '.join(SAMPLINGS)}", param_hint="--sampling")
    if plot_file is not None and not predict:
        raise typer.BadParameter("the learning curve comes from the prediction: leave out --no-predict",
                                 param_hint="--plot")
    path = existing_store(db)
    curves = predict_lib.cost_curves(cost_curve) if predict else []
    selection = dict(formats=fmt, sources=source, models=llm, agents=agent,
                     tenants=None if tenant is None else [tenant])
    with option_errors():
        rows, overall, prediction = predict_lib.entropy_selection(
            path, tokenizer, selection, by=by, sample=sample, seed=seed, max_depth=max_depth, predict=predict,
            curves=curves, sample_calls=sample_calls, sampling=sampling)
    if plot_file is not None and prediction is not None:
        predict_lib.plot(prediction, by, plot_file)
        output.note(f"plot: {plot_file}")
    if json_out:
        extra = {"prediction": prediction["sample"] | {"learning_curve": prediction["learning_curve"],
                                                       "not_covered": NOT_COVERED}} if prediction else {}
        output.print_json({"by": by, "max_depth": max_depth, "sample": sample, "groups": rows, "overall": overall}
                          | extra)
        return
    _print_entropy(rows, overall, prediction, by=by, max_depth=max_depth, curves=curves)


def _print_entropy(rows: list[dict[str, Any]], overall: dict[str, Any], prediction: dict[str, Any] | None, *,
                   by: str, max_depth: int, curves: list[Any]) -> None:
    from .. import predict as predict_lib

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
