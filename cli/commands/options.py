"""Shared command-line options of the specx commands (typer's annotations and their checks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..home import store_path
from ..stack import DRAFTERS

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of a table.")]


DbOpt = Annotated[Optional[Path], typer.Option(
    "--db", help="The store file (default: $SPECX_HOME/specx.db).", envvar="SPECX_DB")]


def existing_store(db: Path | None) -> Path:
    """The store's path for a command that reads one; a missing store is a user error (exit 1)."""
    from ..store.db import StoreError

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
    from ..http.auth import api_key_problem

    problem = api_key_problem(api_key)
    if problem:
        raise typer.BadParameter(problem, param_hint="--api-key")
    return api_key


ListOpt = Optional[list[str]]
ModelOpt = Annotated[str, typer.Option(help="Model: built-in name, HF folder, .gguf file or hub id.",
                                       envvar="SPECX_MODEL")]
DtypeOpt = Annotated[str, typer.Option(help="Weights dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, "
                                             "bfloat16 or float16.")]
BackendOpt = Annotated[str, typer.Option(
    help="What runs the model: auto (for a GGUF, the engine `specx engines` measured fastest here, else a prior), "
         "quantized (specx's own engine on the GGUF's quantized weights: draft trees, batch-invariant kernels), "
         "gpu (a GGUF in bfloat16 on a CUDA GPU: batch-invariant Triton kernels, draft trees, batched requests), "
         "llama.cpp, or transformers (HF folders, the GPU; a GGUF de-quantized to float32).",
    envvar="SPECX_BACKEND")]

DrafterOpt = Annotated[Optional[str], typer.Option(
    "--drafter", help="What drafts: suffix (the suffix index of past outputs and the prompt), table (the model's own successor "
         "table, learned from its verification passes and kept in the store), or hybrid (both in one tree, sized "
         "by the learned cost). Default: hybrid where trees are verified on a GPU, else suffix.",
    envvar="SPECX_DRAFTER", show_default=False)]


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


def _checked_tenant(value: str | None) -> str | None:
    """--tenant's value: a tenant name (store/tenants.check_tenant), '' (the default tenant), or
    None (not given); typer.BadParameter (exit status 2, before anything is read) otherwise."""
    if not value:
        return value
    from ..store.tenants import check_tenant

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
    from ..store.selection import select_calls

    tokenizer_id = store.tokenizer_id(fingerprint)
    if tokenizer_id is None:
        raise typer.BadParameter(f"the store has no tokens for {tokenizer!r}: ingest with --model {tokenizer}",
                                 param_hint="--tokenizer")
    calls = select_calls(store, tokenizer_id, **selection)
    if not calls:
        raise typer.BadParameter("no stored call matches the selection", param_hint="--format/--source/...")
    return tokenizer_id, calls
