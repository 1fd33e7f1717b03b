"""Shared command-line options of the specx commands (typer's annotations and their checks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..home import store_path
from ..stack import DRAFTERS, SettingError

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


@contextmanager
def option_errors() -> Iterator[None]:
    """What the library finds wrong with an option (stack.SettingError: the server's settings, a
    replay's, a generation's) as typer's usage error naming the option (exit status 2)."""
    try:
        yield
    except SettingError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None


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

MaxSpecTokensOpt = Annotated[int, typer.Option(min=0, help="Most draft tokens per step.")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(help="Chat template (Jinja) for the model, or a file "
                                                        "holding one (default: the model's own).",
                                                        show_default=False)]

# which stored calls entropy and replay read (store.selection.select_calls)
FormatsOpt = Annotated[ListOpt, typer.Option("--format", help="Only calls from logs of this format (repeatable).")]
SourcesOpt = Annotated[ListOpt, typer.Option(help="Only calls whose log path contains this (repeatable).")]
LlmsOpt = Annotated[ListOpt, typer.Option(help="Only calls made by a model whose name contains this.")]
AgentsOpt = Annotated[ListOpt, typer.Option(help="Only calls of this agent role (repeatable).")]


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

