"""One sitting of `specx bench tasks`: which servers, the tasks read and cut to the context, each
server started (if it is ours), warmed up, played and stopped in turn, and the report (a table,
or the JSON `--json` prints). The figures themselves are task_bench's; the tasks, tasks'."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import output

from . import task_bench, tasks as task_lib
from .chat_stream import KV_GAUGES, ServerError, base_url, pass_use, server_gauges, served_model, stream_chat
from .task_servers import KINDS, start_server

BUILTIN_CONTEXT = 8192  # SmolLM2-135M-Instruct's
WARM_UP = [{"role": "user", "content": "Say hello."}]  # one untimed request first: lazy set-up is not a turn's


@dataclass
class Plan:
    """The servers in the order they run: (name, URL of a running one or None, kind to start or None)."""

    servers: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    reference: str | None = None
    problem: str | None = None  # a usage error, one line


def plan_servers(given: list[str], start: str | None, reference: str | None) -> Plan:
    """The --server NAME=URL values and the --start list, checked; `problem` says what is wrong.

    >>> plan_servers(["vllm=http://gpu:8000"], "specx-plain", None).servers
    [('vllm', 'http://gpu:8000/v1', None), ('specx-plain', None, 'specx-plain')]
    >>> plan_servers(["gpu:8000"], None, None).problem
    "--server 'gpu:8000': give NAME=URL, e.g. vllm=http://127.0.0.1:8000/v1"
    """
    plan = Plan()
    for value in given:
        name, sep, url = value.partition("=")
        if not sep or not name.strip():
            plan.problem = f"--server {value!r}: give NAME=URL, e.g. vllm=http://127.0.0.1:8000/v1"
            return plan
        try:
            plan.servers.append((name.strip(), base_url(url), None))
        except ServerError as exc:
            plan.problem = f"--server {name.strip()}: {exc}"
            return plan
    for kind in [k.strip() for k in (start or "").split(",") if k.strip()]:
        if kind not in KINDS:
            plan.problem = f"--start {kind!r}: choose from {', '.join(KINDS)}"
            return plan
        plan.servers.append((kind, None, kind))
    names = [name for name, _, _ in plan.servers]
    if not names:
        plan.problem = "no server: name running ones with --server NAME=URL or start some with --start specx,..."
    elif len(set(names)) < len(names):
        plan.problem = f"two servers are named alike: {', '.join(sorted(n for n in set(names) if names.count(n) > 1))}"
    elif reference is not None and reference not in names:
        plan.problem = f"--reference {reference!r} is none of the servers ({', '.join(names)})"
    plan.reference = reference
    return plan


def read_tasks(source: Path | list[Path], counter: task_lib.TokenCounter, num_tasks: int, context: int,
               max_tokens: int, max_message_chars: int | None = None) -> tuple[list[task_lib.Task], int]:
    """The first `num_tasks` tasks of a store (a path) or of logs (a list) that fit the context, cut
    there (each message clipped to `max_message_chars` first), and how many were passed over (their
    first turn does not fit); ServerError when none fits."""
    def fit(task: task_lib.Task) -> task_lib.Task:
        return task_lib.cut(task_lib.clip(task, max_message_chars), context, max_tokens, counter.prompt,
                            counter.answer)

    if isinstance(source, list):
        found = task_lib.iter_log_tasks(source, on_error=lambda message: output.note(f"skipped: {message}"))
        chosen, skipped = task_lib.select(found, num_tasks, fit)
    else:
        from ..store.db import Store

        with Store(source, readonly="auto") as store:
            chosen, skipped = task_lib.select(task_lib.iter_store_tasks(store), num_tasks, fit)
    if not chosen:
        shortest = min((t.needs_tokens for t in skipped if t.needs_tokens is not None), default=None)
        raise ServerError(f"no recorded task whose first turn fits the context ({context:,} tokens)" + (
            f": the shortest first turn needs {shortest:,}, prompt and max_tokens ({len(skipped)} tasks read)"
            if shortest is not None else ""))
    return chosen, len(skipped)


def bench(plan: Plan, *, source: Path | list[Path], num_tasks: int, agents: int, think_time: float,
          max_tokens: int, context: int | None, model: str, api_key: str | None, serve_args: list[str],
          llama_server: Path | None, plot_file: Path | None, max_message_chars: int | None = None) -> dict[str, Any]:
    """The whole sitting; the report as a JSON-able dict. ServerError (one line) for a --server
    that does not answer, or no task to play."""
    from ..home import specx_home
    from ..core.model.load import BUILTIN, load_tokenizer

    models = {name: served_model(url, api_key) for name, url, _ in plan.servers if url is not None}
    tokenizer = load_tokenizer(model, specx_home() / "models")
    if context is None:
        limit = getattr(tokenizer, "model_max_length", 0) or 0
        context = BUILTIN_CONTEXT if model in BUILTIN or not 0 < limit <= 1 << 20 else int(limit)
    counter = task_lib.TokenCounter(tokenizer)
    tasks, skipped = read_tasks(source, counter, num_tasks, context, max_tokens, max_message_chars)
    num_turns = sum(len(t.turns) for t in tasks)
    output.note(f"{len(tasks)} tasks, {num_turns} turns (prompts up to "
                f"{max(t.prompt_tokens for task in tasks for t in task.turns):,} tokens; context {context:,}, "
                f"at most {max_tokens} tokens a turn)" + (f"; {skipped} tasks passed over: their first turn "
                                                          "does not fit" if skipped else ""))
    runs: list[task_bench.ServerRun] = []
    problems: dict[str, str] = {}
    memory: dict[str, dict[str, Any]] = {}  # per server: its peak resident memory (started ones), its kept KV
    with tempfile.TemporaryDirectory(prefix="specx-bench-tasks-") as workdir:
        for name, url, kind in plan.servers:
            started = None
            try:
                if kind is not None:
                    output.note(f"{name}: starting")
                    started = start_server(kind, model=model, workdir=Path(workdir), slots=agents, context=context,
                                           serve_args=serve_args, llama_server=llama_server)
                    url = started.url
                    models[name] = served_model(url)
                key = None if started else api_key
                stream_chat(url, models[name], WARM_UP, 1, key)
                before = server_gauges(url, key)
                with output.progress() as bar:
                    task = bar.add_task(name, total=num_turns)
                    runs.append(task_bench.run_tasks(name, url, models[name], tasks, agents=agents,
                                                     think_time=think_time, api_key=key, count_tokens=counter.answer,
                                                     on_turn=lambda answer: bar.advance(task)))
                after = server_gauges(url, key)
                kv = {k: int(after[k]) for k in KV_GAUGES.values() if k in after}
                use = pass_use(before, after)
                memory[name] = {"peak_rss_bytes": started.peak_rss() if started else None, **kv,
                                **({"passes": use} if use.get("passes") else {})}
            except ServerError as exc:
                problems[name] = str(exc)
                output.note(f"{name}: skipped: {exc}")
            finally:
                if started is not None:
                    started.stop()
    reference = _reference(plan, runs)
    if plot_file is not None and runs:
        task_bench.plot(tasks, runs, plot_file)
        output.note(f"plot: {plot_file}")
    servers = []
    for name, _, kind in plan.servers:
        run = next((r for r in runs if r.name == name), None)
        if run is None:
            servers.append({"name": name, "started": kind is not None, "error": problems.get(name)})
            continue
        other = None if reference is None or reference.name == name else reference
        servers.append({"name": name, "started": kind is not None, "url": run.url, "model": run.model,
                        "error": None, **task_bench.summarize(run, other), **memory.get(name, {}),
                        "turns_detail": task_bench.turns_json(run, other)})
    return {"settings": {"tasks": num_tasks, "agents": agents, "think_time_s": think_time, "max_tokens": max_tokens,
                         "context": context, "model": model, "reference": reference.name if reference else None},
            "tasks": [{"key": t.key, "turns": len(t.turns), "prompt_tokens": [turn.prompt_tokens for turn in t.turns],
                       "max_tokens": [turn.max_tokens for turn in t.turns]} for t in tasks],
            "tasks_passed_over": skipped, "servers": servers}


def _reference(plan: Plan, runs: list[task_bench.ServerRun]) -> task_bench.ServerRun | None:
    """The run answers are compared with: --reference's, else specx-plain's, else the first (None: fewer than two)."""
    if len(runs) < 2 and plan.reference is None:
        return None
    wanted = plan.reference or ("specx-plain" if any(r.name == "specx-plain" for r in runs) else runs[0].name)
    found = next((r for r in runs if r.name == wanted), None)
    if found is None:
        output.note(f"reference {wanted}: it did not run; answers are not compared")
    return found


def print_table(result: dict[str, Any]) -> None:
    """The report as `specx bench` prints it: one row a server, a skipped one with its reason."""
    s = result["settings"]
    rows = []
    for row in result["servers"]:
        if row["error"] is not None:
            rows.append([row["name"], "skipped"] + [None] * 12)
            continue
        same = f"{row['identical']}/{row['compared']}" if row["compared"] is not None else (
            "reference" if row["name"] == s["reference"] else None)
        rows.append([row["name"], row["tasks"], row["turns"], row["failed_turns"], row["task_s_median"],
                     row["task_s_p90"], row["task_s_total"], row["ttft_s_median"], row["decode_tokens_per_s"],
                     row["prompt_tokens_computed"], row["prompt_tokens_reused"], row["tokens_per_step"],
                     row["peak_rss_bytes"] / 2**30 if row.get("peak_rss_bytes") else None, same])
    turns = sum(t["turns"] for t in result["tasks"])
    output.print_table(
        f"{len(result['tasks'])} recorded tasks, {turns} turns, {s['agents']} at once (context {s['context']:,}, "
        f"at most {s['max_tokens']} tokens a turn, greedy)",
        ["server", "tasks", "turns", "failed", "task s median", "task s p90", "task s total", "TTFT s median",
         "decode tok/s", "prompt computed", "prompt reused", "tokens/step", "peak RSS GiB",
         f"identical to {s['reference']}" if s["reference"] else "identical"], rows,
        caption="lower is better for seconds; higher for tok/s, reused and tokens/step; - where a server does not say")
    for row in result["servers"]:
        if row["error"] is not None:
            output.note(f"{row['name']}: {row['error']}")
        elif "kv_budget_tokens" in row:
            output.note(f"{row['name']}: conversations' KV kept at the end {row.get('kv_kept_tokens', 0):,} tokens of "
                        f"a {row['kv_budget_tokens']:,}-token --kv-memory; {row.get('kv_evicted_tokens', 0):,} tokens "
                        "pushed out (prefilled again on their next turn)")
        if row.get("passes"):
            use = row["passes"]
            rows = use.get("prefill_rows", 0) + use.get("step_rows", 0)
            output.note(f"{row['name']}: the model computed {use['busy_s']:.1f} s of the run's {row['wall_s']:.1f} s, "
                        f"{int(use['passes']):,} batched passes of {int(rows):,} rows, "
                        f"{use.get('prefill_rows', 0) / max(rows, 1):.0%} of them prompts' prefill")
