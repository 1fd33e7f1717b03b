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


def check_api_key(api_key: str | None) -> str | None:
    """`--api-key` as clients can send it, or typer.BadParameter (one line at start): a key is sent
    in an HTTP header (`Authorization: Bearer KEY`), which carries visible ASCII only, so a key
    with other characters (non-ASCII, spaces, control characters) could never be matched.

    >>> check_api_key("s3cret-KEY_1")
    's3cret-KEY_1'
    >>> try:
    ...     check_api_key("clé")
    ... except typer.BadParameter as exc:
    ...     print(exc.format_message())
    Invalid value for --api-key: the API key holds 'é' (U+00E9): clients send the key in an HTTP header, ...
    """
    from specx.cli.http.app import api_key_problem

    problem = api_key_problem(api_key)
    if problem:
        raise typer.BadParameter(problem, param_hint="--api-key")
    return api_key


ListOpt = Optional[list[str]]
BackendOpt = Annotated[str, typer.Option(
    help="What runs the model: auto (for a GGUF, the engine `specx engines` measured fastest here, else a prior), "
         "quantized (specx's own engine on the GGUF's quantized weights: draft trees, batch-invariant kernels), "
         "gpu (a GGUF in bfloat16 on a CUDA GPU: batch-invariant Triton kernels, draft trees, batched requests), "
         "llama.cpp, or transformers (HF folders, the GPU; a GGUF de-quantized to float32).",
    envvar="SPECX_BACKEND")]

DRAFTERS = ("suffix", "table", "hybrid")  # --drafter's choices (cli/assemble.py builds them)
DrafterOpt = Annotated[Optional[str], typer.Option(
    "--drafter", help="What drafts: suffix (the suffix index of past outputs and the prompt), table (the model's own successor "
         "table, learned from its verification passes and kept in the store), or hybrid (both in one tree, sized "
         "by the learned cost). Default: hybrid where trees are verified on a GPU, else suffix.",
    envvar="SPECX_DRAFTER", show_default=False)]


def default_drafter(engine: Any) -> str:
    """What serve, generate and replay --model draft with unless told on `engine` (a
    core.model.engine.Engine): the hybrid where it verifies trees on an accelerator (an H200: 1.23x
    the suffix index's tokens/s on text-to-SQL 0-shot, 1.03x 3-shot, 1.00x chat answers), else the
    suffix index. On a CPU the learned cost keeps few table nodes and the table's own work is not
    repaid: on the 2-core AVX-512 Xeon 0.96-1.00x the suffix index's tokens/s on text-to-SQL 0-shot
    in five runs, 0.99-1.04x on chat answers in four; on llama.cpp, whose passes cost in proportion
    to their tokens, 0.983x on average over ten runs (docs/benchmarks.md, sessions 35 and 36)."""
    return "hybrid" if engine.tree_unsupported is None and engine.device != "cpu" else "suffix"


def check_drafters(value: str | None, *, many: bool = False) -> list[str]:
    """--drafter's value as a list (`many`: a comma-separated list; None, not given: empty, the
    engine's default_drafter once it is loaded), or BadParameter naming the choices."""
    if value is None:
        return []
    names = [v.strip() for v in value.split(",")] if many else [value]
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown or not names:
        raise typer.BadParameter(f"{', '.join(unknown) or value!r}: choose {'from' if many else 'one of'} "
                                 f"{', '.join(DRAFTERS)}", param_hint="--drafter")
    return names


def model_cost(engine: Any, model: str, say: Callable[[str], None], relearn: bool = False) -> Any:
    """The forward-pass cost (core.cost.learned.LearnedCost) of `model` on `engine` (a
    core.model.engine.Engine), learned from the passes it runs:
    nothing is timed at start. It starts from what earlier runs learned for this model, dtype,
    kernels and machine (kept in $SPECX_HOME/cost/learned-<digest of the key>.json; `relearn`:
    forgotten), else from a shipped curve's shape (the cpu curve; for a model on llama.cpp,
    llama.cpp's); `keep_cost` saves it."""
    import hashlib
    import json

    from specx.core.cost.learned import load_learned_cost
    from specx.core.cost.shipped import shipped_curves

    key, prior = _cost_key(engine, model)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = specx_home() / "cost" / f"learned-{digest}.json"
    return load_learned_cost(shipped_curves()[prior].cost, kept_at=path, key=key, say=say, relearn=relearn)


def _cost_key(engine: Any, model: str) -> tuple[dict[str, Any], str]:
    """What a learned cost is kept by (the model, what runs it: Engine.cost_key, the machine) and
    the name of the shipped curve it starts from (core.cost.shipped; Engine.cost_curve)."""
    import platform

    from specx.core.model.cpu import model_name

    machine = {"cpu": model_name(), "cpus": os.cpu_count(), "platform": platform.platform()}
    return {"model": model} | engine.cost_key() | machine, engine.cost_curve


def keep_cost(cost: Any, say: Callable[[str], None] = lambda message: None) -> None:
    """Save what `cost` (from model_cost) has learned, for the next run on this model and machine
    (core.cost.learned.LearnedCost.keep); a file that cannot be written is one line, not an error."""
    try:
        cost.keep()
    except (OSError, ValueError) as exc:
        say(f"forward-pass cost: cannot keep it in {cost.kept_at} ({exc})")


def _checked_tenant(value: str | None) -> str | None:
    """--tenant's value: a tenant name (store/tenants.check_tenant), '' (the default tenant), or
    None (not given); typer.BadParameter (exit status 2, before anything is read) otherwise."""
    if not value:
        return value
    from specx.store.tenants import check_tenant

    try:
        return check_tenant(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def tenant_option(help: str) -> Any:
    """The --tenant option of ingest, merge, entropy and replay, checked as it is parsed."""
    return typer.Option("--tenant", help=help, callback=_checked_tenant, show_default=False)


def stored_calls(store: Any, fingerprint: str, tokenizer: str, **selection: Any) -> tuple[int, list[Any]]:
    """(tokenizer id, the calls `selection` picks: store.selection.select_calls) for the tokenizer
    with this fingerprint; a usage error naming the option when the store has no tokens for it or
    nothing matches (entropy and replay)."""
    from specx.store.selection import select_calls

    tokenizer_id = store.tokenizer_id(fingerprint)
    if tokenizer_id is None:
        raise typer.BadParameter(f"the store has no tokens for {tokenizer!r}: ingest with --model {tokenizer}",
                                 param_hint="--tokenizer")
    calls = select_calls(store, tokenizer_id, **selection)
    if not calls:
        raise typer.BadParameter("no stored call matches the selection", param_hint="--format/--source/...")
    return tokenizer_id, calls
