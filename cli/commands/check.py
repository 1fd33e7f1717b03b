"""`specx check`: the store's full health check (registered in app.py)."""

from __future__ import annotations

import typer

from .. import output
from .options import DbOpt, JsonOpt, existing_store


def check_cmd(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Check the store in full, reading only: SQLite's integrity check, every pack, call and token row
    readable, and each persisted index consistent with the token rows it covers. Exit status 1 when
    anything is wrong, each problem named.

    Every command already refuses a store that fails SQLite's quicker check at open, or that a newer
    specx wrote; this says what exactly is wrong, and finds what the quick check cannot see.

    Example: [bold]specx check --db ~/.local/share/specx/specx.db --json[/]
    """
    from ..store.check import check_store

    path = existing_store(db)
    report = check_store(path)
    if json_out:
        output.print_json(report.to_json())
    else:
        output.print_table(f"check {report.path}", ["check", "ok", "detail"],
                           [[c.name, c.ok, c.detail] for c in report.checks])
        for c in report.checks:
            for problem in c.problems:
                output.error(f"{c.name}: {problem}")
            if c.num_problems > len(c.problems):
                output.error(f"{c.name}: ... and {c.num_problems - len(c.problems)} more")
    if not report.ok:
        raise typer.Exit(1)
