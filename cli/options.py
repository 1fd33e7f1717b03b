"""Shared command-line options and paths of the specx commands."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]


def specx_home() -> Path:
    """Where specx keeps its store and caches: $SPECX_HOME, else the platform's data dir."""
    env = os.environ.get("SPECX_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("specx", appauthor=False))


def default_agent_data() -> Path | None:
    """The public agent logs beside this checkout (../shared/agent-data), if present."""
    env = os.environ.get("SPECX_AGENT_DATA")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent
    candidates += [Path.cwd() / "shared" / "agent-data", Path.cwd().parent / "shared" / "agent-data",
                   here.parent / "shared" / "agent-data"]
    return next((p for p in candidates if p.is_dir()), None)


DbOpt = Annotated[Optional[Path], typer.Option(
    "--db", help="The store file (default: $SPECX_HOME/specx.db).", envvar="SPECX_DB")]


def store_path(db: Path | None) -> Path:
    return db if db is not None else specx_home() / "specx.db"


def existing_store(db: Path | None) -> Path:
    """The store's path for a command that reads one; a missing store is a user error (exit 1)."""
    from specx.store.db import StoreError

    path = store_path(db)
    if not path.exists():
        raise StoreError(f"no store at {path} (run `specx ingest` first, or pass --db)")
    return path


ListOpt = Optional[list[str]]
