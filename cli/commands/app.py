"""The `specx` command line: each command parses, calls the library, prints.

main() is the one place where domain errors become messages and exit codes: 0 ok, 1 user error,
2 bad usage (typer's own), 130 interrupted. SPECX_DEBUG=1 shows tracebacks instead.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import output
from ..home import specx_home, store_path
from .check import check_cmd
from .engines import engines_cmd
from .entropy import entropy_cmd
from .generate import generate_cmd
from .merge import merge_cmd
from .options import DbOpt, JsonOpt, existing_store, tenant_option
from .replay import replay_cmd
from .serve import serve_cmd

app = typer.Typer(
    name="specx",
    help="Agent-trace accelerator: speculative decoding from a suffix index over your agents' past outputs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _add_plugin_commands() -> None:
    """Sub-commands that other packages add through the `specx.commands` entry points: `specx bench`
    is the measuring package's (specx.bench.command), so the commands here never import it."""
    from importlib.metadata import entry_points

    for point in entry_points(group="specx.commands"):
        app.add_typer(point.load(), name=point.name)


_add_plugin_commands()


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Log files and folders (searched recursively).")],
    fmt: Annotated[Optional[str], typer.Option("--format", help="Read every file as this format instead of "
                                                                  "detecting it from content.")] = None,
    model: Annotated[str, typer.Option("--model", "--tokenizer", help="Whose tokenizer to tokenize outputs with: "
                                       "built-in name, HF folder or .gguf file.", envvar="SPECX_MODEL")] = "smollm2-135m",
    tenant: Annotated[str, tenant_option("Whose history the logs are: a tenant name (1-64 letters, digits, '_', "
                                         "'.', '-'; 'public': shared, every tenant drafts from it). Default: the "
                                         "default tenant. The same file for two tenants is two histories.")] = "",
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Read agent logs into the store: calls (prompts and outputs), output tokens, and the suffix index.

    Formats are detected from content: OpenHands (output.jsonl, trajectories, prompt/response log folders),
    SWE-agent .traj, OpenAI-style chat logs (JSON Lines), MMSQL-style multi-agent text-to-SQL JSON,
    one-SQL-per-line predictions, {prompt, completion} JSON Lines, Aider chat history, Claude Code
    stream-json. Re-ingesting unchanged files adds nothing. Exit status 1 if any file or record failed.

    Example: [bold]specx ingest ../shared/agent-data --json[/]
    """
    from ..core.model.load import load_tokenizer, tokenizer_fingerprint
    from ..store.db import Store
    from ..store.formats import FORMATS
    from ..store.ingest import Tokenizer, find_inputs, ingest as run_ingest

    if fmt is not None and fmt not in FORMATS:
        raise typer.BadParameter(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}", param_hint="--format")
    tokenizer = Tokenizer(model, lambda: load_tokenizer(model, specx_home() / "models"), tokenizer_fingerprint)
    inputs = find_inputs(paths, fmt)
    path = store_path(db)
    if not inputs.logs and not path.exists():
        report = inputs.report  # nothing to read: no store is created for it
    else:
        with Store(path) as store, output.progress() as bar:
            task = bar.add_task("ingest", total=len(inputs.logs))
            report = run_ingest(store, inputs, tokenizer, tenant=tenant,
                                on_file=lambda p: bar.update(task, advance=1, description=f"ingest {p.name}"))
    if json_out:
        output.print_json(report.to_json())
    else:
        rows = [[name, n] for name, n in sorted(report.by_format.items())]
        output.print_table(f"ingested {report.files} files ({report.skipped_files} unchanged): {report.calls:,} calls,"
                           f" {report.new_calls:,} new, {report.duplicate_calls:,} already stored,"
                           f" {report.new_tokens:,} new tokens", ["format", "calls"], rows)
        if report.index:
            output.note(f"index: {report.index['action']}, {report.index['calls']:,} outputs, "
                        f"{report.index['tokens']:,} tokens ({report.index['seconds']:.2f} s)")
        if report.unrecognized:
            output.note(f"skipped {len(report.unrecognized)} files no format claims (listed with --json)")
        for e in report.errors[:50]:
            where = f"{e['path']}:{e['line']}" if e["line"] is not None else e["path"]
            output.error(f"{where}: {e['message']}")
        if len(report.errors) > 50:
            output.error(f"... and {len(report.errors) - 50} more errors (see --json)")
    if report.errors:
        raise typer.Exit(1)


@app.command("ls")
def ls(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """What the store holds: sources by format, sessions, calls, tokens per tokenizer, bytes on disk vs raw logs.

    A store with tenants besides the default one also lists each tenant's calls.

    Example: [bold]specx ls --json[/]
    """
    from ..store.db import Store
    from ..store.tenants import tenants_in

    path = existing_store(db)
    with Store(path, readonly="auto") as store:
        stats = store.stats()
        columns = {row[1] for row in store.db.execute("PRAGMA table_info(sources)")}
        stats["tenants"] = tenants_in(store) if "tenant" in columns else {}  # read-only and older: none
    if json_out:
        output.print_json(stats)
        return
    if set(stats["tenants"]) - {""}:
        output.print_table("tenants", ["tenant", "calls"],
                           [[name or "(default)", n] for name, n in stats["tenants"].items()])
    output.print_table(f"{stats['path']}", ["format", "sources", "calls", "raw bytes"],
                       [[r["format"], r["sources"], r["calls"], r["raw_bytes"]] for r in stats["by_format"]])
    output.print_table("tokens", ["tokenizer", "fingerprint", "calls", "tokens", "indexed tokens"],
                       [[r["name"], r["fingerprint"], r["calls"], r["tokens"], r["indexed_tokens"]]
                        for r in stats["tokenizers"]])
    ratio = stats["disk_bytes"] / stats["raw_log_bytes"] if stats["raw_log_bytes"] else float("nan")
    output.print_table("totals", ["sources", "failed", "sessions", "calls", "messages", "disk bytes",
                                  "raw log bytes", "disk / raw"],
                       [[stats["sources"], stats["sources_failed"], stats["sessions"], stats["calls"],
                         stats["messages"], stats["disk_bytes"], stats["raw_log_bytes"], ratio]])


app.command("replay")(replay_cmd)
app.command("entropy")(entropy_cmd)
app.command("check")(check_cmd)
app.command("merge")(merge_cmd)
app.command("generate")(generate_cmd)
app.command("serve")(serve_cmd)
app.command("engines")(engines_cmd)


def main() -> None:
    """Console-script entry point: domain errors become one clear line and exit status 1."""
    from ..core.index.tokens import SuffixIndexError
    from ..core.model.load import ModelError
    from ..core.predict.entropy import EntropyError
    from ..core.decode.verifiers.recorded import ReplayMismatch
    from ..store.db import StoreError
    from ..store.formats import ParseError

    from ..core.numba_cache import prune

    prune()  # the compiled kernels of older sources (never at import: see core/numba_cache.py)
    try:
        code = app(standalone_mode=False)
    except (SuffixIndexError, ModelError, ParseError, StoreError, ReplayMismatch, EntropyError, OSError) as exc:
        if os.environ.get("SPECX_DEBUG"):
            raise
        output.error(str(exc))
        sys.exit(1)
    except sqlite3.DatabaseError as exc:
        # Damage the check at open did not see (it came later, or in a page no b-tree reaches).
        if os.environ.get("SPECX_DEBUG"):
            raise
        output.error(f"the store cannot be read: {exc} (`specx check` lists what is wrong)")
        sys.exit(1)
    except KeyboardInterrupt:
        output.error("interrupted")
        sys.exit(130)
    except typer.Abort:
        output.error("aborted")
        sys.exit(1)
    except Exception as exc:
        # Usage errors (click's, raised because standalone_mode is off) know how to show themselves.
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    sys.exit(code if isinstance(code, int) else 0)
