"""`specx bench tasks` (specx.bench.tasks, task_bench, task_runs, chat_stream): recorded tasks
grouped into turns, the context cut, the statistics on hand-worked numbers, the stream read from
a small OpenAI-style server on loopback (llama-server's `timings` form too), usage errors as one
line, and (slow) the whole command against real `specx serve` servers it starts itself."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers.cli import specx_in_process
from specx.bench import chat_stream, task_bench, task_runs
from specx.bench.chat_stream import Answer
from specx.bench.tasks import Task, Turn, cut, group_calls, iter_log_tasks, iter_store_tasks, median, percentile, select

FIXTURES = Path(__file__).parent / "fixtures" / "formats"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def words(text: str) -> int:
    return len(text.split())


# --------------------------------------------------------------------------- tasks and turns

def test_calls_group_into_tasks_in_recorded_order():
    rows = [("b", 0, user("b0"), "B0"), ("a", 2, user("a2"), "A2"), ("a", 0, user("a0"), "A0"),
            ("c", 0, None, "no prompt"), ("a", 1, user("a1"), "A1"), ("a", 1, user("a1 again"), "A1'")]
    tasks = group_calls(rows)
    assert [t.key for t in tasks] == ["b", "a"]  # order of first appearance; "c" has no turn
    assert [t.answer for t in tasks[1].turns] == ["A0", "A1", "A1'", "A2"]  # by position, ties as recorded


def test_recorded_roles_go_out_as_any_server_takes_them():
    [task] = group_calls([("t", 0, [{"role": "system", "content": "s"}, {"role": "tool", "content": "out"},
                                     {"role": "prompt_text", "content": [{"type": "text", "text": "p"}]}], "x")])
    assert task.turns[0].messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "out"},
                                      {"role": "user", "content": "p"}]


def test_a_trajectory_and_a_multi_agent_dialogue_from_logs():
    by_key = {t.key: t for t in iter_log_tasks([FIXTURES / "swe_agent", FIXTURES / "mmsql_multiagent.json"])}
    swe = by_key["swe-agent:demo__repo-1.traj:demo__repo-1"]
    first, second = swe.turns
    assert second.messages[: len(first.messages)] == first.messages  # the conversation grows turn by turn
    assert len(second.messages) > len(first.messages) and second.messages[len(first.messages)]["role"] == "assistant"
    [mmsql] = [t for k, t in by_key.items() if k.startswith("text2sql-multiagent:mmsql_multiagent.json:")]
    assert len(mmsql.turns) == 5


def test_a_store_holds_the_same_tasks_as_its_logs(tmp_path):
    from specx.store.db import Store

    db = tmp_path / "s.db"
    done = specx_in_process("ingest", str(FIXTURES / "swe_agent" / "demo__repo-1.traj"),
                            str(FIXTURES / "mmsql_multiagent.json"), "--db", str(db))
    assert done.returncode == 0, done.stderr
    with Store(db) as store:
        stored = {t.key: t.turns for t in iter_store_tasks(store)}
    logged = {t.key: t.turns for t in iter_log_tasks([FIXTURES / "swe_agent" / "demo__repo-1.traj",
                                                      FIXTURES / "mmsql_multiagent.json"])}
    assert stored == logged and len(stored) == 2


def test_the_context_cut_and_max_tokens():
    task = Task("t", [Turn(user("a b c"), "one two three four five"), Turn(user("a b c d e"), ""),
                      Turn(user("a b c d e f g h"), "x"), Turn(user("a"), "x")])
    prompt = lambda messages: words(messages[0]["content"])  # noqa: E731
    # turn 1: 3 + min(4, 5) = 7 fits 10; turn 2: 5 + 1 (an empty answer still asks one token) = 6;
    # turn 3: 8 + 1 = 9; with context 8 the task ends before turn 3 (turn 4, short again, is not played)
    assert [(t.prompt_tokens, t.max_tokens) for t in cut(task, 10, 4, prompt, words).turns] == [(3, 4), (5, 1), (8, 1), (1, 1)]
    assert [(t.prompt_tokens, t.max_tokens) for t in cut(task, 8, 4, prompt, words).turns] == [(3, 4), (5, 1)]
    assert cut(task, 8, 4, prompt, words).needs_tokens == 9  # what turn 3 needed
    nothing = cut(task, 6, 4, prompt, words)  # 3 + 4 = 7 > 6: not even the first turn
    assert nothing.turns == [] and nothing.needs_tokens == 7
    tasks = [Task("long", [Turn(user("a b c d e f g h i"), "x")]), task, Task("short", [Turn(user("a"), "x")])]
    chosen, skipped = select(tasks, 1, lambda t: cut(t, 8, 4, prompt, words))
    assert [t.key for t in chosen] == ["t"] and [(t.key, t.needs_tokens) for t in skipped] == [("long", 10)]


def test_median_and_p90_on_hand_worked_numbers():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    # rank 0.9 * (5 - 1) = 3.6: 40 + 0.6 * (50 - 40)
    assert percentile([50.0, 10.0, 40.0, 20.0, 30.0], 90) == pytest.approx(46.0)
    assert percentile([7.0], 90) == 7.0 and median([]) is None


def test_a_servers_row_on_hand_worked_numbers():
    def a(text, seconds, ttft, tokens, prompt, cached, steps, error=None):
        return Answer(text, seconds, ttft, tokens, prompt, cached, steps, "stop", error)

    run = task_bench.ServerRun("s", "u", "m", [
        [a("x", 1.0, 0.2, 9, 100, 0, 3), a("y", 2.0, 0.5, 4, 150, 100, 2)],  # task 1: 3.0 s
        [a("z", 4.0, 1.0, 1, 80, None, None)],                                # task 2: 4.0 s
        [a("w", 0.5, None, None, None, None, None, error="HTTP 400: too long")]], 9.0)  # task 3 failed
    reference = task_bench.ServerRun("r", "u", "m", [[Answer("x"), Answer("other")], [Answer("z")], [Answer("w")]],
                                     8.0)
    row = task_bench.summarize(run, reference)
    assert (row["tasks"], row["turns"], row["failed_turns"]) == (3, 4, 1)
    assert row["task_s_median"] == pytest.approx(3.5) and row["task_s_p90"] == pytest.approx(3.9)  # of 3.0, 4.0
    assert row["task_s_total"] == pytest.approx(7.0)
    assert row["ttft_s_median"] == pytest.approx(0.5)  # of 0.2, 0.5, 1.0
    # decode: (9 - 1) + (4 - 1) tokens over (1.0 - 0.2) + (2.0 - 0.5) s; a one-token answer has no decode
    assert row["decode_tokens_per_s"] == pytest.approx(11 / 2.3)
    assert (row["prompt_tokens_computed"], row["prompt_tokens_reused"]) == (150, 100)  # said by two turns
    assert row["tokens_per_step"] == pytest.approx(13 / 5)
    assert (row["identical"], row["compared"]) == (2, 3)  # the failed turn is not compared
    details = task_bench.turns_json(run, reference)
    assert [d["identical"] for d in details[0]] == [True, False] and details[2][0]["identical"] is None
    assert "text" not in details[0][0]


def test_usage_timings_and_step_counts_as_each_server_says_them():
    openai_style = Answer()
    openai_style.read_usage({"prompt_tokens": 500, "completion_tokens": 20,
                             "prompt_tokens_details": {"cached_tokens": 448}}, None, {"steps": 8})
    assert (openai_style.prompt_tokens, openai_style.cached_tokens, openai_style.steps) == (500, 448, 8)
    vllm = Answer()
    vllm.read_usage({"prompt_tokens": 500, "completion_tokens": 20}, None, None)
    assert (vllm.cached_tokens, vllm.steps) == (None, None)
    plain_llama = Answer()  # llama-server without drafts: no draft_n, one token a step
    plain_llama.read_usage({"prompt_tokens": 500, "completion_tokens": 20},
                           {"prompt_n": 52, "cache_n": 448, "predicted_n": 20}, None)
    assert (plain_llama.cached_tokens, plain_llama.steps) == (448, 20)


def test_server_plans_and_their_one_line_problems():
    plan = task_runs.plan_servers(["a=http://127.0.0.1:1/v1", "b=https://host"], "specx,specx-plain", "b")
    assert [n for n, _, _ in plan.servers] == ["a", "b", "specx", "specx-plain"] and plan.problem is None
    assert plan.servers[1][1] == "https://host/v1"
    assert "NAME=URL" in task_runs.plan_servers(["http://x:1"], None, None).problem
    assert "not an http(s) URL" in task_runs.plan_servers(["a=ftp://x"], None, None).problem
    assert "choose from" in task_runs.plan_servers([], "vllm", None).problem
    assert "alike" in task_runs.plan_servers(["specx=http://x:1"], "specx", None).problem
    assert "none of the servers" in task_runs.plan_servers([], "specx", "llama-server").problem
    assert "no server" in task_runs.plan_servers([], None, None).problem


# --------------------------------------------------------------------------- a small server on loopback

class FakeServer(BaseHTTPRequestHandler):
    """OpenAI's streamed chat completions as llama-server sends them: the answer repeats the last
    message's first word, the last chunk carries `timings`; a message "fail" gets HTTP 400."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["temperature"] == 0 and body["model"] == "fake-model"
        last = body["messages"][-1]["content"]
        if last == "fail":
            return self._json(400, {"error": {"message": "no such thing", "type": "invalid_request_error"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        words_out = [(last.split() or ["-"])[0]] * min(3, body["max_tokens"])
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": w + " "}}]} for w in words_out]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                       "timings": {"prompt_n": 5, "cache_n": 10, "predicted_n": len(words_out), "draft_n": 2,
                                   "draft_n_accepted": 1}})
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def _json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_one_streamed_turn_read_from_a_server(fake_server):
    assert chat_stream.served_model(fake_server) == "fake-model"
    answer = chat_stream.stream_chat(fake_server, "fake-model", user("hello there"), 8)
    assert answer.error is None and answer.text == "hello hello hello "
    assert 0 < answer.ttft_s <= answer.seconds and answer.finish_reason == "length"
    assert (answer.prompt_tokens, answer.cached_tokens, answer.completion_tokens, answer.steps) == (15, 10, 3, 2)
    failed = chat_stream.stream_chat(fake_server, "fake-model", user("fail"), 8)
    assert failed.error == "HTTP 400: no such thing"


def test_the_command_against_a_running_server_json_unpolluted(fake_server, tmp_path):
    plot = tmp_path / "tasks.png"
    done = specx_in_process("bench", "tasks", "--logs", str(FIXTURES / "swe_agent"), "--logs",
                            str(FIXTURES / "mmsql_multiagent.json"), "--server", f"fake={fake_server}",
                            "--server", f"again={fake_server}", "--tasks", "2", "--agents", "2",
                            "--think-time", "0.01", "--max-tokens", "2", "--json", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # nothing else on stdout
    assert [t["turns"] for t in result["tasks"]] == [2, 5]
    assert all(m <= 2 for t in result["tasks"] for m in t["max_tokens"])
    fake, again = result["servers"]
    assert result["settings"]["reference"] == "fake" and again["identical"] == again["compared"] == 7
    assert fake["turns"] == 7 and fake["failed_turns"] == 0 and fake["prompt_tokens_reused"] == 70
    assert fake["tokens_per_step"] == pytest.approx(14 / 7)  # 2 tokens a turn, 1 accepted draft: 1 step
    assert fake["peak_rss_bytes"] is None and "kv_budget_tokens" not in fake  # not started here, no KV gauges
    assert plot.stat().st_size > 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("value, code, says", [
    ("x=notaurl", 2, "--server x: 'notaurl' is not an http(s) URL"),
    ("x", 2, "--server 'x': give NAME=URL"),
    (f"x=http://127.0.0.1:{_closed_port()}/v1", 1, "cannot reach http://127.0.0.1:"),
])
def test_a_bad_server_url_is_one_line(value, code, says):
    done = specx_in_process("bench", "tasks", "--logs", str(FIXTURES / "swe_agent"), "--server", value)
    assert done.returncode == code
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and says in done.stderr, done.stderr
    assert done.stdout == ""


def test_no_task_that_fits_is_one_line(fake_server):
    done = specx_in_process("bench", "tasks", "--logs", str(FIXTURES / "swe_agent"), "--server", f"fake={fake_server}",
                            "--context", "40")
    assert done.returncode == 1 and done.stdout == ""
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: no recorded task whose first turn fits the context (40 tokens): the shortest "
                           "first turn needs ") and last.endswith(", prompt and max_tokens (1 tasks read)"), last


def test_a_server_that_cannot_start_is_skipped(fake_server, tmp_path):
    done = specx_in_process("bench", "tasks", "--logs", str(FIXTURES / "swe_agent"), "--server", f"fake={fake_server}",
                            "--start", "llama-server", "--llama-server", str(tmp_path / "none"), "--json")
    assert done.returncode == 0, done.stderr
    fake, llama = json.loads(done.stdout)["servers"]
    assert fake["turns"] == 2 and llama["error"].startswith("llama-server: no llama-server binary")
    assert "llama-server: skipped" in done.stderr


# --------------------------------------------------------------------------- the real thing

@pytest.mark.slow
def test_specx_against_plain_specx_on_recorded_tasks(tmp_path):
    """Two real `specx serve` started by the command (~15 s each once the model is converted): the
    same answers (lossless), the second turn of a task reusing the first's prompt KV, steps told."""
    done = specx_in_process("bench", "tasks", "--logs", str(FIXTURES / "swe_agent"), "--logs",
                            str(FIXTURES / "openhands_output.jsonl"), "--start", "specx,specx-plain",
                            "--serve-arg=--backend=quantized", "--tasks", "2", "--max-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    specx, plain = result["servers"]
    assert result["settings"]["reference"] == "specx-plain" and [t["turns"] for t in result["tasks"]] == [2, 2]
    for row in (specx, plain):
        assert row["error"] is None and row["failed_turns"] == 0 and row["turns"] == 4
        assert row["ttft_s_median"] > 0 and row["task_s_total"] > 0 and row["tokens_per_step"] >= 1
        assert row["prompt_tokens_reused"] > 0  # each task's second turn starts with its first's prompt
        assert row["peak_rss_bytes"] > 100 * 2**20  # the model's weights at least, read from /proc
        assert row["kv_budget_tokens"] > 0 and row["kv_evicted_tokens"] == 0 and row["kv_kept_tokens"] > 0
        use = row["passes"]  # the run's batched passes, from the server's /metrics before and after it
        assert 0 < use["busy_s"] < row["wall_s"] and use["passes"] >= row["turns"]
        assert 0 < use["prefill_rows"] <= row["prompt_tokens_computed"] and use["step_rows"] >= row["turns"]
    assert specx["identical"] == specx["compared"] == 4
    assert plain["tokens_per_step"] == 1.0
