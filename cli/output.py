"""Terminal output: data on stdout (a rich table, or JSON with --json), progress and errors on stderr."""

from __future__ import annotations

import json
import math
import sys
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True)


def print_json(data: Any) -> None:
    """One JSON document on stdout, nothing else (machines parse it)."""
    sys.stdout.write(json.dumps(data, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(format_value(v) for v in row))
    stdout.print(table)


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1e6:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def progress() -> Progress:
    """A progress bar on stderr (hidden when stderr is not a terminal)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=stderr, transient=True, disable=not stderr.is_terminal)


def error(message: str) -> None:
    # One line whatever its length (not wrapped at the terminal's width): scripts grep for it.
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)


def note(message: str) -> None:
    stderr.print(message, highlight=False)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
