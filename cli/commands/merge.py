"""`specx merge`: other stores' calls into this one (replicas on other machines, docs/vllm.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import output
from .options import DbOpt, JsonOpt, tenant_option
from ..home import store_path


def merge_cmd(
    stores: Annotated[list[Path], typer.Argument(help="The stores to merge in (read only).")],
    tenant: Annotated[Optional[str], tenant_option("Merge every source into this tenant's history (the same "
                                                   "store merged for two tenants is two histories). Default: each "
                                                   "source keeps its own tenant.")] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Merge other stores into this one: the calls it lacks, their prompts and token rows, then the index.

    Calls are matched by content, so what both stores hold (a common seed, an earlier merge) is not
    copied again, and merging twice adds nothing. A store that cannot be read is reported and the
    others are merged (exit status 1); so is a successor table that is damaged or for another
    vocabulary (named with its store). `--json` gives each store's outcome under "stores". The way to scale past one machine: each replica serves and
    records into its own store (SPECX_RECORD=1), and the central store merges them. With --tenant,
    a source of another tenant gets the keys it has in that tenant's history.

    Example: [bold]specx merge replica-a.db replica-b.db --db central.db --json[/]
    """
    from ..store.db import Store, StoreError
    from ..store.merge import merge

    path = store_path(db)
    results, errors, outcomes = [], [], []
    with Store(path) as dest:
        for other in stores:
            try:
                if not other.is_file():
                    raise StoreError(f"{other}: no such store")
                with Store(other, readonly=True) as src, output.progress() as bar:
                    task = bar.add_task(f"merge {other.name}: sources", total=None)
                    report = merge(dest, src, on_source=lambda p: bar.advance(task), tenant=tenant)
            except (StoreError, ValueError) as exc:
                errors.append(str(exc))
                outcomes.append({"store": str(other), "outcome": "not merged", "errors": [str(exc)]})
                continue
            results.append({"store": str(other)} | report.to_json())
            errors += [f"{other}: {message}" for message in report.damaged]
            outcomes.append({"store": str(other), "outcome": "merged in part" if report.damaged else "merged",
                             "errors": [f"{other}: {message}" for message in report.damaged]})
            output.note(f"{other}: {report.new_calls:,} new calls ({report.known_calls:,} already here), "
                        f"{report.new_token_rows:,} token rows")
    if json_out:
        output.print_json({"db": str(path), "merged": results, "errors": errors, "stores": outcomes})
    else:
        keys = ["sources", "new_sources", "new_sessions", "new_calls", "known_calls", "new_messages", "new_token_rows"]
        output.print_table(f"merged into {path}", ["store"] + keys, [[r["store"]] + [r[k] for k in keys] for r in results],
                           caption="known_calls: held by both stores, not copied")
        for message in errors:
            output.error(message)
    if errors:
        raise typer.Exit(1)
