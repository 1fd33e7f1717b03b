"""Terminal output: data on stdout (a rich table, or JSON with --json), progress and errors on stderr."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Off a terminal (a log, a pipe, CI) rich would cut tables to 80 columns ("toke…"): give them room instead.
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 250)
stderr = Console(stderr=True, width=None if sys.stderr.isatty() else 250)


def print_json(data: Any) -> None:
    """One JSON document on stdout, nothing else (machines parse it)."""
    sys.stdout.write(json.dumps(data, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str | None = None) -> None:
    """A table on stdout; `caption` (under it) says which direction is better."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
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


def progress(every: float = 10.0) -> "Progress | LineProgress":
    """A progress bar on stderr; off a terminal (a log, CI), a line every `every` seconds instead."""
    if not stderr.is_terminal:
        return LineProgress(every)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=stderr, transient=True)


class LineProgress:
    """Progress for logs and CI, where a bar cannot redraw: a line on stderr every `every` seconds
    and one at the end (the API subset of rich's Progress that specx uses)."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self.tasks: list[dict[str, Any]] = []

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        for task in self.tasks:
            if task["printed"] != task["completed"]:
                self._print(task)

    def add_task(self, description: str, total: float | None = None) -> int:
        now = time.monotonic()
        self.tasks.append({"description": description, "total": total, "completed": 0, "start": now,
                           "last": now, "printed": 0})
        return len(self.tasks) - 1

    def update(self, task_id: int, advance: float = 0, description: str | None = None,
               total: float | None = None) -> None:
        task = self.tasks[task_id]
        task["completed"] += advance
        if total is not None:
            task["total"] = total
        if description is not None:
            task["description"] = description
        if time.monotonic() - task["last"] >= self.every or task["completed"] == task["total"]:
            self._print(task)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def _print(self, task: dict[str, Any]) -> None:
        now = time.monotonic()
        total = f"/{task['total']:,.0f}" if task["total"] is not None else ""
        stderr.print(f"{task['description']}: {task['completed']:,.0f}{total} ({now - task['start']:.0f} s)",
                     highlight=False, soft_wrap=True)
        task["last"], task["printed"] = now, task["completed"]

    def track(self, sequence: Sequence[Any], description: str = "") -> Iterable[Any]:
        task = self.add_task(description, total=len(sequence))
        for item in sequence:
            yield item
            self.advance(task)




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
