"""specx's home folder ($SPECX_HOME) and what it keeps there: the default store, the forward-pass
cost each model has learned on this machine (kept between runs); and where the public agent logs
lie beside a checkout."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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


def store_path(db: Path | None) -> Path:
    return db if db is not None else specx_home() / "specx.db"


def model_cost(engine: Any, model: str, say: Callable[[str], None], relearn: bool = False) -> Any:
    """The forward-pass cost (core.cost.learned.LearnedCost) of `model` on `engine` (a
    core.model.engine.Engine), learned from the passes it runs:
    nothing is timed at start. It starts from what earlier runs learned for this model, dtype,
    kernels and machine (kept in $SPECX_HOME/cost/learned-<digest of the key>.json; `relearn`:
    forgotten), else from a shipped curve's shape (the cpu curve; for a model on llama.cpp,
    llama.cpp's); `keep_cost` saves it."""
    import hashlib
    import json

    from .core.cost.learned import load_learned_cost
    from .core.cost.shipped import shipped_curves

    key, prior = _cost_key(engine, model)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = specx_home() / "cost" / f"learned-{digest}.json"
    return load_learned_cost(shipped_curves()[prior].cost, kept_at=path, key=key, say=say, relearn=relearn)


def _cost_key(engine: Any, model: str) -> tuple[dict[str, Any], str]:
    """What a learned cost is kept by (the model, what runs it: Engine.cost_key, the machine) and
    the name of the shipped curve it starts from (core.cost.shipped; Engine.cost_curve)."""
    import platform

    from .core.model.cpu import model_name

    machine = {"cpu": model_name(), "cpus": os.cpu_count(), "platform": platform.platform()}
    return {"model": model} | engine.cost_key() | machine, engine.cost_curve


def keep_cost(cost: Any, say: Callable[[str], None] = lambda message: None) -> None:
    """Save what `cost` (from model_cost) has learned, for the next run on this model and machine
    (core.cost.learned.LearnedCost.keep); a file that cannot be written is one line, not an error."""
    try:
        cost.keep()
    except (OSError, ValueError) as exc:
        say(f"forward-pass cost: cannot keep it in {cost.kept_at} ({exc})")
