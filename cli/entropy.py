"""`specx entropy`: how predictable the stored outputs are, per group."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from . import output
from .options import DbOpt, JsonOpt, ListOpt, existing_store, specx_home


def entropy_cmd(
    db: DbOpt = None,
    tokenizer: Annotated[str, typer.Option(help="Tokenizer whose stored tokens to measure (as given to ingest).",
                                           envvar="SPECX_MODEL")] = "smollm2-135m",
    by: Annotated[str, typer.Option(help="Group by: format, source, model, agent or session.")] = "format",
    sample: Annotated[Optional[int], typer.Option(min=1, help="Use N outputs per group, drawn at random (the "
                                                              "SuffixDecoding paper finds ~100 enough).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for --sample.")] = 0,
    max_depth: Annotated[int, typer.Option(min=1, max=512, help="Deepest context (index node) counted.")] = 64,
    fmt: Annotated[ListOpt, typer.Option("--format", help="Only calls from logs of this format (repeatable).")] = None,
    source: Annotated[ListOpt, typer.Option(help="Only calls whose log path contains this (repeatable).")] = None,
    llm: Annotated[ListOpt, typer.Option(help="Only calls made by a model whose name contains this.")] = None,
    agent: Annotated[ListOpt, typer.Option(help="Only calls of this agent role (repeatable).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """How predictable are the stored outputs? Empirical entropy per group, before any model runs.

    entropy_bits: over every context (suffix-index node) of 1 to max-depth tokens in the outputs, the
    entropy of the token that follows it, averaged weighted by the context's occurrences. Low means
    structured, repetitive output: long accepted drafts. H0..H4 are the plain order-k conditional
    entropies for reference.

    Example: [bold]specx entropy --by agent --sample 100[/]
    """
    import numpy as np

    from specx.core.entropy import empirical_entropy
    from specx.core.model import load_tokenizer, tokenizer_fingerprint
    from specx.store.db import Store
    from specx.store.selection import GROUPS, select_calls

    if by not in GROUPS:
        raise typer.BadParameter(f"must be one of {', '.join(GROUPS)}", param_hint="--by")
    path = existing_store(db)
    tok = load_tokenizer(tokenizer, specx_home() / "models")
    rng = np.random.default_rng(seed)
    with Store(path) as store:
        tokenizer_id = store.tokenizer_id(tokenizer_fingerprint(tok))
        if tokenizer_id is None:
            raise typer.BadParameter(f"the store has no tokens for {tokenizer!r}: ingest with --model {tokenizer}",
                                     param_hint="--tokenizer")
        calls = select_calls(store, tokenizer_id, formats=fmt, sources=source, models=llm, agents=agent)
        if not calls:
            raise typer.BadParameter("no stored call matches the selection", param_hint="--format/--source/...")
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
    if json_out:
        output.print_json({"by": by, "max_depth": max_depth, "sample": sample, "groups": rows, "overall": overall})
        return
    columns = ["calls", "tokens", "entropy_bits", "H0", "H1", "H2", "H3", "H4"]
    output.print_table(f"empirical entropy by {by} (bits; contexts of 1-{max_depth} tokens)", [by] + columns,
                       [[r["key"], r["calls"], r["tokens"], r["entropy_bits"], *r["order_bits"]]
                        for r in rows + [overall]],
                       caption="lower bits: more predictable outputs (a description, not a predicted speedup)")


def _entropy_row(result, calls: int) -> dict:
    return {"calls": calls, "tokens": result.num_tokens, "entropy_bits": result.entropy_bits,
            "order_bits": result.order_bits, "contexts": result.num_contexts}
