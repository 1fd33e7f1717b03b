"""Shared command-line options and paths of the specx commands."""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Any, Optional

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


def model_cost(net: Any, model: str, say: Callable[[str], None], refresh: bool = False, **options: Any) -> Any:
    """The model's forward-pass cost curve (core.cost.cached_cost), kept in $SPECX_HOME/cost per
    model, dtype, kernels and machine: measured at the first start only, checked for sanity,
    re-measured or replaced by the shipped cpu curve's shape when it cannot be right."""
    import platform

    import torch

    from specx.core.cost import cached_cost
    from specx.core.predict import builtin_curves

    cpu = platform.processor()
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = str(net.device)
    key = {"model": model, "model_type": getattr(net.config, "model_type", None),
           "parameters": sum(p.numel() for p in net.parameters()), "dtype": str(net.dtype), "device": device,
           "gpu": torch.cuda.get_device_name(net.device) if device.startswith("cuda") else None,
           "kernels": list(getattr(net, "specx_kernels", [])), "cpu": cpu, "cpus": os.cpu_count(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform()}
    return cached_cost(net, specx_home() / "cost", key, builtin_curves()["cpu"].cost, say, refresh=refresh, **options)
