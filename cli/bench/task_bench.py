"""`specx bench tasks`: recorded agent tasks replayed turn by turn against servers, and the figures.

`run_tasks` plays every task against one server: a task's turns in order (each one streamed chat
completion, chat_stream.stream_chat), `agents` tasks at once (threads), `think_time` seconds
between an agent's turns (the agent's own time: never counted in the task's time). `summarize`
turns one server's answers into its row of the table:

    task_s       a task's time: the sum of its turns' request-to-last-token seconds (median, p90, total,
                 over the tasks none of whose turns failed)
    ttft_s       time to first token of a turn (median)
    decode/s     tokens after the first over the seconds after the first token, summed over turns
    computed     prompt tokens the server prefilled, and `reused` those whose KV it kept (where it says)
    tokens/step  answer tokens over the server's forward passes (where it says: specx, llama-server)
    identical    turns whose answer is the reference server's, character for character, of those both answered
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .chat_stream import Answer, stream_chat
from .tasks import Task, median, percentile


@dataclass
class ServerRun:
    """One server's answers: answers[i][k] is task i's turn k."""

    name: str
    url: str
    model: str
    answers: list[list[Answer]]
    wall_s: float


def run_tasks(name: str, url: str, model: str, tasks: Sequence[Task], *, agents: int = 1, think_time: float = 0.0,
              api_key: str | None = None, count_tokens: Callable[[str], int] | None = None,
              on_turn: Callable[[Answer], None] = lambda answer: None) -> ServerRun:
    """Every task against the server at `url`, `agents` at a time; an answer whose server did not
    say its completion tokens is counted with `count_tokens` (the bench's tokenizer) when given."""

    stopping = threading.Event()  # set when the run is interrupted: agents stop at their next turn

    def play(task: Task) -> list[Answer]:
        answers = []
        for k, turn in enumerate(task.turns):
            if stopping.is_set() or k and think_time and stopping.wait(think_time):
                break
            answer = stream_chat(url, model, turn.messages, turn.max_tokens, api_key)
            if answer.completion_tokens is None and answer.error is None and count_tokens is not None:
                answer.completion_tokens = count_tokens(answer.text)
            answers.append(answer)
            on_turn(answer)
        return answers

    started = time.perf_counter()
    pool = ThreadPoolExecutor(max(1, agents))
    try:
        answers = list(pool.map(play, tasks))
    finally:  # Ctrl-C: no wait for every task to play out (the caller then stops the server)
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
    return ServerRun(name, url, model, answers, time.perf_counter() - started)


def _sum_known(values: Sequence[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def summarize(run: ServerRun, reference: ServerRun | None = None) -> dict[str, Any]:
    """The row of one server (see the module's docstring); None where nothing was said or measured."""
    turns = [a for answers in run.answers for a in answers]
    ok = [a for a in turns if a.error is None]
    task_s = [sum(a.seconds for a in answers) for answers in run.answers if all(a.error is None for a in answers)]
    decoding = [a for a in ok if a.ttft_s is not None and (a.completion_tokens or 0) >= 2]
    decode_s = sum(a.seconds - a.ttft_s for a in decoding)
    with_cache = [a for a in ok if a.cached_tokens is not None and a.prompt_tokens is not None]
    stepped = [a for a in ok if a.steps and a.completion_tokens is not None]
    row: dict[str, Any] = {
        "tasks": len(run.answers), "turns": len(turns), "failed_turns": len(turns) - len(ok),
        "task_s_median": median(task_s), "task_s_p90": percentile(task_s, 90),
        "task_s_total": sum(task_s) if task_s else None,
        "ttft_s_median": median([a.ttft_s for a in ok if a.ttft_s is not None]),
        "decode_tokens_per_s": sum(a.completion_tokens - 1 for a in decoding) / decode_s if decode_s > 0 else None,
        "completion_tokens": _sum_known([a.completion_tokens for a in ok]),
        "prompt_tokens_computed": sum(a.prompt_tokens - a.cached_tokens for a in with_cache) if with_cache else None,
        "prompt_tokens_reused": sum(a.cached_tokens for a in with_cache) if with_cache else None,
        "tokens_per_step": (sum(a.completion_tokens for a in stepped) / sum(a.steps for a in stepped)
                            if stepped else None),
        "identical": None, "compared": None, "wall_s": run.wall_s}
    if reference is not None:
        pairs = [(a, b) for mine, theirs in zip(run.answers, reference.answers) for a, b in zip(mine, theirs)
                 if a.error is None and b.error is None]
        row["identical"] = sum(a.text == b.text for a, b in pairs)
        row["compared"] = len(pairs)
    return row


def turns_json(run: ServerRun, reference: ServerRun | None = None) -> list[list[dict[str, Any]]]:
    """Each turn's figures (its text left out), with `identical` to the reference's answer when there is one."""
    out = []
    for i, answers in enumerate(run.answers):
        rows = []
        for k, answer in enumerate(answers):
            row = {key: value for key, value in asdict(answer).items() if key != "text"}
            if reference is not None:
                other = reference.answers[i][k]
                row["identical"] = None if answer.error or other.error else answer.text == other.text
            rows.append(row)
        out.append(rows)
    return out


def plot(tasks: Sequence[Task], runs: Sequence[ServerRun], path: Path) -> None:
    """Time to first token against the turn's prompt tokens (left) and each task's time (right), per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(runs))
    for j, run in enumerate(runs):
        points = [(turn.prompt_tokens, a.ttft_s) for task, answers in zip(tasks, run.answers)
                  for turn, a in zip(task.turns, answers) if a.ttft_s is not None]
        left.scatter([p for p, _ in points], [t for _, t in points], s=12, alpha=0.7, label=run.name)
        seconds = [sum(a.seconds for a in answers) for answers in run.answers]
        right.bar([i - 0.4 + width * (j + 0.5) for i in range(len(seconds))], seconds, width=width, label=run.name)
    right.set_xticks(range(len(tasks)), [str(i + 1) for i in range(len(tasks))])
    left.set_xlabel("prompt tokens of the turn")
    left.set_ylabel("time to first token (s)")
    left.set_title("time to first token, per turn")
    right.set_xlabel("task")
    right.set_ylabel("task time (s)")
    right.set_title("task time (think time excluded)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
