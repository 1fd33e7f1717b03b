"""`specx bench index`, `ingest` and `cost`: figures side by side in one run (specx.bench.figures measures)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import output
from ..commands.options import JsonOpt, existing_store
from ..home import default_agent_data, specx_home

bench_app = typer.Typer(help="Benchmarks that print a table (or JSON) comparing side by side in one run.",
                        no_args_is_help=True)


@bench_app.command("index")
def bench_index(
    tokens: Annotated[int, typer.Option(min=1000, help="Size of the synthetic corpus, in tokens.")] = 1_000_000,
    positions: Annotated[int, typer.Option(min=1, help="Held-out positions to draft at.")] = 2000,
    logs: Annotated[Optional[Path], typer.Option(
        help="Folder of agent logs to benchmark too (default: ../shared/agent-data when present).")] = None,
    no_logs: Annotated[bool, typer.Option("--no-logs", help="Only the synthetic corpus.")] = False,
    model: Annotated[str, typer.Option(help="Tokenizer for the logs: built-in name, HF folder or .gguf file.",
                                       envvar="SPECX_MODEL")] = "smollm2-135m",
    reference: Annotated[bool, typer.Option(help="Also run ArcticInference's suffix tree when importable.")] = True,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic corpus and the held-out split.")] = 0,
    json_out: JsonOpt = False,
) -> None:
    """Suffix-index figures: build and load speed, bytes per token, append and draft latency, accepted tokens.

    Example: [bold]specx bench index --tokens 1000000 --json[/]
    """
    from ..core.model.load import load_tokenizer
    from ..core.predict.methods import reference_available, why_reference_unavailable
    from . import figures as bench

    corpora = []
    output.note(f"synthetic corpus: {tokens:,} tokens of templated JSON-like records (seed {seed})")
    corpora.append(bench.bench_corpus("synthetic-json", bench.synthetic_docs(tokens, seed), num_positions=positions,
                                      seed=seed, with_reference=reference, on_step=output.note))
    root = None if no_logs else (logs or default_agent_data())
    if logs is not None and not logs.is_dir():
        raise typer.BadParameter(f"{logs} is not a folder", param_hint="--logs")
    if root is not None:
        tokenizer = load_tokenizer(model, specx_home() / "models")
        docs, by_format = bench.agent_log_docs(root, tokenizer)
        output.note(f"agent logs: {root} ({sum(by_format.values()):,} calls: "
                    + ", ".join(f"{k} {v}" for k, v in sorted(by_format.items())) + ")")
        corpora.append(bench.bench_corpus("agent-logs", docs, num_positions=positions, seed=seed,
                                          with_reference=reference, on_step=output.note))
    elif not no_logs:
        output.note("agent logs: not found (pass --logs FOLDER); synthetic corpus only")
    if reference and not reference_available():
        output.note(f"reference: not importable ({why_reference_unavailable()}); specx figures only")
    primary = corpora[0]["specx"]
    result = {**primary, "targets_met": bench.check_targets(primary), "corpora": corpora, "machine": bench.machine()}
    if json_out:
        output.print_json(result)
        return
    _print_bench_table(corpora)


@bench_app.command("ingest")
def bench_ingest(
    logs: Annotated[Optional[Path], typer.Argument(
        help="Folder of agent logs (default: ../shared/agent-data when present).")] = None,
    model: Annotated[str, typer.Option(help="Tokenizer: built-in name, HF folder or .gguf file.",
                                       envvar="SPECX_MODEL")] = "smollm2-135m",
    json_out: JsonOpt = False,
) -> None:
    """Ingest a folder into a new store and again: seconds, calls added, store size vs the logs, index load.

    Example: [bold]specx bench ingest ../shared/agent-data --json[/]
    """
    import tempfile

    from ..core.model.load import load_tokenizer, tokenizer_fingerprint
    from ..store.ingest import Tokenizer
    from . import figures as bench

    root = logs or default_agent_data()
    if root is None or not root.is_dir():
        raise typer.BadParameter(f"{root or 'agent logs'} is not a folder", param_hint="LOGS")
    tokenizer = Tokenizer(model, lambda: load_tokenizer(model, specx_home() / "models"), tokenizer_fingerprint)
    with tempfile.TemporaryDirectory() as tmp:
        result = bench.bench_ingest(root, Path(tmp), tokenizer, on_step=output.note)
    result["targets_met"] = {"ingest_s": result["ingest_s"] <= 60, "reingest_s": result["reingest_s"] <= 5,
                             "reingest_new_calls": result["reingest_new_calls"] == 0,
                             "store_vs_logs": result["store_vs_logs"] <= 0.25}
    if json_out:
        output.print_json({**result, "machine": bench.machine()})
        return
    targets = {"ingest_s": "<= 60", "reingest_s": "<= 5", "reingest_new_calls": "0", "store_vs_logs": "<= 0.25"}
    output.print_table(f"ingest {root}", ["metric", "value", "target"],
                       [[k, v, targets.get(k, "")] for k, v in result.items() if k != "targets_met"])


@bench_app.command("cost")
def bench_cost(
    model: Annotated[str, typer.Option(help="Built-in name, HF folder or .gguf file.", envvar="SPECX_MODEL")]
    = "smollm2-135m",
    backend: Annotated[str, typer.Option(help="The engine to time: auto (as serve resolves it), quantized, llama.cpp "
                                              "or transformers.")] = "transformers",
    context: Annotated[int, typer.Option(min=1, help="Tokens in the cache the passes run on.")] = 128,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per size (the median is kept).")] = 5,
    dtype: Annotated[str, typer.Option(help="Weights dtype on transformers: auto, float32, bfloat16, float16.")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="Write the curve here, a file for `specx entropy "
                                                     "--cost-curve` and `specx replay --cost-curve`.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """What one verification pass over k tokens costs on this machine, relative to one token (plain decoding).

    The forward-cost curve the prediction turns tokens per step into a speedup with (the shipped
    `cpu` curve is this command's output for the built-in model on the development machine), and
    beside it what the machine allows: the bytes of weights a pass reads and its multiply-adds per
    token, this machine's memory bandwidth and float32 peak (measured now), and how far the
    one-token pass is from the memory-bound limit (weights and cached keys and values / bandwidth).

    Example: [bold]specx bench cost --model my-model.gguf --backend quantized --out my-model.json[/]
    """
    import json

    import torch

    from .calibrate import SIZES, calibrate, machine_limits, pass_bytes
    from ..core.model.load import load_backend

    from ..backends import resolve_backend

    torch.set_grad_enabled(False)
    engine_name = resolve_backend(model, backend, output.note)
    output.note(f"loading {model} on {engine_name}")
    net, _ = load_backend(model, specx_home() / "models", engine_name, dtype=dtype)
    output.note(f"timing passes over {', '.join(map(str, SIZES))} tokens on a {context}-token cache")
    cost = calibrate(net, repeats=repeats, context=context, long_context=None)
    from . import figures as bench

    ms = {str(k): round(s * 1000, 3) for k, s in zip(cost.sizes, cost.seconds)}
    machine = bench.machine()
    weight_bytes, multiply_adds = pass_bytes(net)
    from ..core.model.prefix_cache import kv_bytes_per_token

    kv_bytes = kv_bytes_per_token(net) * context  # every pass reads the cached keys and values too
    limits = machine_limits()
    bound_ms = (weight_bytes + kv_bytes) / (limits["memory_gb_s"] * 1e9) * 1000
    roofline = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "multiply_adds_per_token": multiply_adds, **limits,
                "memory_bound_ms": round(bound_ms, 3), "one_token_vs_memory_bound": round(ms["1"] / bound_ms, 2),
                "arithmetic_ms_per_token": round(2 * multiply_adds / (limits["float32_gflop_s"] * 1e9) * 1000, 3)}
    from ..core.model import cpu

    curve = {"about": f"{model} on {net.name} ({net.precision}) on {cpu.model_name()}, {machine['cpus']} CPUs "
                      f"({torch.get_num_threads()} threads): milliseconds of one verification pass over k tokens on "
                      f"a {context}-token cache, median of {repeats} (`specx bench cost`)", "cost": ms,
             "engine": net.name, "roofline": roofline}
    if out is not None:
        out.write_text(json.dumps(curve, indent=1) + "\n")
        output.note(f"curve: {out}")
    if json_out:
        output.print_json(curve)
        return
    base = cost.seconds[0]
    output.print_table(f"one verification pass, {model} on {net.name}", ["tokens", "ms", "relative to 1"],
                       [[k, v, round(v / 1000 / base, 3)] for k, v in ms.items()],
                       caption="lower is better; a flat curve (a large model on a GPU) makes every draft token free")
    output.print_table("what the machine allows", ["figure", "value"], [
        ["weights a pass reads (MB)", round(weight_bytes / 1e6, 1)],
        [f"keys and values of {context:,} cached tokens (MB)", round(kv_bytes / 1e6, 1)],
        ["multiply-adds per token (M)", round(multiply_adds / 1e6, 1)],
        ["memory bandwidth, measured (GB/s)", limits["memory_gb_s"]],
        ["float32 peak, measured (GFLOP/s)", limits["float32_gflop_s"]],
        ["memory-bound one-token pass (ms)", round(bound_ms, 2)],
        ["one-token pass / memory-bound", roofline["one_token_vs_memory_bound"]],
        ["float32 arithmetic per token at peak (ms)", roofline["arithmetic_ms_per_token"]]])


@bench_app.command("tasks")
def bench_tasks(
    server: Annotated[Optional[list[str]], typer.Option(
        "--server", help="NAME=URL of a running OpenAI-compatible server (repeatable), e.g. "
                         "vllm=http://gpu:8000/v1.", show_default=False)] = None,
    start: Annotated[Optional[str], typer.Option(
        help="Servers to start here, one after another (comma-separated): specx, specx-plain (--no-speculation), "
             "llama-server (-np C --cache-reuse 256), llama-server-ngram (--spec-type ngram-mod).",
        show_default=False)] = None,
    db: Annotated[Optional[Path], typer.Option(
        "--db", help="The store whose tasks are replayed (default: $SPECX_HOME/specx.db).", envvar="SPECX_DB")] = None,
    logs: Annotated[Optional[list[Path]], typer.Option(
        help="Replay the tasks of these log files or folders instead of a store's (repeatable).",
        show_default=False)] = None,
    num_tasks: Annotated[int, typer.Option("--tasks", min=1, help="Tasks to replay (the first ones that fit).")] = 10,
    agents: Annotated[int, typer.Option(min=1, help="Tasks played at once (an agent each).")] = 1,
    think_time: Annotated[float, typer.Option(min=0, help="Seconds an agent waits between its turns.")] = 0.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens asked per turn (else the recorded "
                                                        "answer's length).")] = 128,
    context: Annotated[Optional[int], typer.Option(min=16, help="Tokens a turn may fill, prompt and answer; a "
                                                   "task ends before a turn that outgrows it (default: the "
                                                   "model's, 8192 for the built-in).", show_default=False)] = None,
    max_message_chars: Annotated[Optional[int], typer.Option(min=1, help="Cut every message to its first N "
                                                             "characters, the same at every turn (to fit long "
                                                             "demonstrations into a small model's context).",
                                                             show_default=False)] = None,
    reference: Annotated[Optional[str], typer.Option(help="The server whose answers the others are compared with "
                                                     "(default: specx-plain when it runs, else the first).",
                                                     show_default=False)] = None,
    model: Annotated[str, typer.Option(help="What started servers run (built-in name, HF folder, .gguf file), and "
                                            "whose tokenizer counts tokens.", envvar="SPECX_MODEL")] = "smollm2-135m",
    api_key: Annotated[Optional[str], typer.Option(help="Bearer key for the --server servers.",
                                                   envvar="OPENAI_API_KEY", show_default=False)] = None,
    serve_arg: Annotated[Optional[list[str]], typer.Option(help="One more argument for the `specx serve` started "
                                                           "(repeatable), e.g. --serve-arg=--backend=quantized.",
                                                           show_default=False)] = None,
    llama_server: Annotated[Optional[Path], typer.Option(help="The llama-server binary (default: on PATH, else "
                                                         "the one examples/model_ladder.py builds).",
                                                         show_default=False)] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG or SVG: time to first token per "
                                                      "turn and each task's time, per server.",
                                                      show_default=False)] = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay recorded agent tasks turn by turn against servers, side by side: task time, time to first token, prompt reuse.

    Each task (a trajectory, a dialogue, a conversation) is played as its agent played it: every
    turn sends the recorded conversation up to that answer (streamed, greedy, max_tokens the
    recorded answer's length), turns in order. Servers run one at a time; the table gives each
    one's task time, time to first token, decode speed, the prompt tokens it computed and reused
    (from `usage` or llama-server's `timings`), tokens per step where it says them, how many
    answers are identical to the reference server's, the peak resident memory of a server it
    started, and the conversations' KV a specx server kept and pushed out (its /metrics). A server
    that cannot be started is reported and skipped.

    Example: [bold]specx bench tasks --db agents.db --tasks 4 --start specx,specx-plain,llama-server[/]
    Example: [bold]specx bench tasks --logs trajs/ --server vllm=http://gpu:8000/v1 --agents 4 --json[/]
    """
    from . import task_runs
    from .chat_stream import ServerError

    if plot_file is not None and plot_file.suffix.lower() not in (".png", ".svg"):
        raise typer.BadParameter("must end in .png or .svg", param_hint="--plot")
    if db is not None and logs:
        raise typer.BadParameter("replay a store (--db) or logs (--logs), not both", param_hint="--logs")
    plan = task_runs.plan_servers(server or [], start, reference)
    if plan.problem:
        output.error(plan.problem)
        raise typer.Exit(2)
    try:
        result = task_runs.bench(plan, source=logs or existing_store(db), num_tasks=num_tasks, agents=agents,
                                 think_time=think_time, max_tokens=max_tokens, context=context, model=model,
                                 api_key=api_key, serve_args=serve_arg or [], llama_server=llama_server,
                                 plot_file=plot_file, max_message_chars=max_message_chars)
    except ServerError as exc:  # a --server that does not answer, no task to play: one line
        output.error(str(exc))
        raise typer.Exit(1) from None
    if json_out:
        output.print_json(result)
        return
    task_runs.print_table(result)


def _print_bench_table(corpora: list[dict]) -> None:
    from .figures import TARGETS

    keys = ["tokens", "build_tokens_per_s", "bytes_per_token", "load_tokens_per_s", "append_us_per_token",
            "add_us_per_token", "speculate_p50_us", "speculate_p99_us", "mean_accepted",
            "path_speculate_p50_us", "path_mean_accepted"]
    columns = ["metric"]
    for c in corpora:
        columns.append(f"specx {c['corpus']}")
        if c["reference"] is not None:
            columns.append(f"reference {c['corpus']}")
    columns.append("target")
    rows = []
    for key in keys:
        row = [key]
        for c in corpora:
            row.append(c["specx"].get(key))
            if c["reference"] is not None:
                row.append(c["reference"].get(key))
        op_bound = TARGETS.get(key)
        row.append(f"{op_bound[0]} {op_bound[1]:,}" if op_bound else "")
        rows.append(row)
    positions = ", ".join(f"{c['corpus']}: {c['positions']:,}" for c in corpora)
    output.print_table(f"suffix index (held-out positions {positions}; max_spec_tokens 32, tree)", columns, rows,
                       caption="higher is better for tokens_per_s and mean_accepted; lower for us and bytes")
