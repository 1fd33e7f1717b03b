"""`specx serve` as agents use it: a real server on a free loopback port (conftest's `server`, shared
with test_serve_agents.py), the official openai client.

Request validation has its own fast tests (test_http_requests.py); servers started for one test
each (restart, start options, SIGTERM, loading) are test_serve_lifecycle.py's, agents' features
(tools, structured output, logprobs, the frameworks) test_serve_agents.py's, the store of served
requests and the worker without a server test_serve_worker.py's. These start `python -m specx serve`
subprocesses with the built-in model.
"""

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers.cli import specx_in_process
from helpers.servers import COUNTING, KEY, MODEL, Server, ask, post, specx_home


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    """One request decoded at a time, one waiting, plain decoding (slow steps: easy to be busy)."""
    srv = Server(specx_home(tmp_path_factory), tmp_path_factory.mktemp("busy") / "busy.db", "--max-queue", "1",
                 "--no-speculation")
    yield srv
    srv.stop()


def test_text_identical_to_specx_generate(server, tmp_path):
    prompt = "Write one SQL query listing the names of singers older than 30."
    client = server.client()
    chat = ask(client, prompt, 24)
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    for extra, answer, usage in [([], chat.choices[0].message.content, chat.usage),
                                 (["--raw"], raw.choices[0].text, raw.usage)]:
        # --fixed-size: no cost calibration (the text is the same either way; lossless)
        run = specx_in_process("generate", prompt, "--max-tokens", "24", "--json", "--fixed-size", "--db",
                               str(tmp_path / "none.db"), *extra)
        assert run.returncode == 0, run.stderr[-2000:]
        reference = json.loads(run.stdout)
        assert answer == reference["text"]
        assert usage.completion_tokens == reference["tokens"]
    assert chat.model == MODEL and chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")


def test_chat_streaming_equals_non_streaming_with_usage(server):
    client = server.client()
    whole = ask(client, "Name three colours.", 20)
    chunks = list(ask(client, "Name three colours.", 20, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == whole.usage.total_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    # the same prompt again: all of it but the last token (read with the first draft) from the prefix cache
    assert last.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    assert last.model_extra["specx"]["steps"] >= 1
    plain = list(ask(client, "Name three colours.", 20, stream=True))  # no usage chunk unless asked
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_completions_stream_and_not_and_stop_strings(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert whole.choices[0].text.startswith(" 6, 7,")
    parts = list(client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 12
    for stream in (False, True):
        answer = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0, stop=[" 8"],
                                           stream=stream)
        chunks = list(answer) if stream else [answer]
        assert "".join(c.choices[0].text for c in chunks) == " 6, 7,"
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_get_their_own_answers(server):
    questions = ["What is 2 + 2?", "Name a fruit.", "Say hello in French.", "What colour is the sky?"]
    sequential = [ask(server.client(), q).choices[0].message.content for q in questions]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = ask(server.client(), questions[i]).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results.get(i) for i in range(len(questions))] == sequential


def test_n_choices(server):
    answer = ask(server.client(), "Name a fruit.", 8, n=2)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content == answer.choices[1].message.content  # greedy: the same twice
    assert answer.usage.completion_tokens == 2 * ask(server.client(), "Name a fruit.", 8).usage.completion_tokens
    sampled = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=8, temperature=0.9, seed=7, n=3)
    assert len(sampled.choices) == 3 and all(c.finish_reason in ("stop", "length") for c in sampled.choices)


def test_bad_input_gets_openai_errors_and_the_server_goes_on(server):
    import openai

    chat, completions = server.url + "/v1/chat/completions", server.url + "/v1/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        (chat, b"{not json", KEY, 400, "invalid_json"),
        (chat, json.dumps({"model": MODEL}).encode(), KEY, 400, "missing_required_parameter"),
        (chat, json.dumps({**good, "model": "gpt-4o"}).encode(), KEY, 404, "model_not_found"),
        (chat, json.dumps({**good, "max_tokens": -1}).encode(), KEY, 400, "integer_below_min_value"),
        (chat, json.dumps({**good, "max_tokens": 10**9}).encode(), KEY, 400, "context_length_exceeded"),
        (completions, json.dumps({"model": MODEL, "prompt": "word " * 9000}).encode(), KEY, 400,
         "context_length_exceeded"),
        (chat, json.dumps(good).encode(), "wrong-key", 401, "invalid_api_key"),
        (chat, json.dumps(good).encode(), None, 401, "invalid_api_key"),
        # issue 39: a lone surrogate anywhere (in `stop` it ended the worker thread), text that cannot fit
        (chat, json.dumps({**good, "stop": ["\ud800"]}).encode(), KEY, 400, "invalid_value"),
        (chat, json.dumps({**good, "model": "\ud800"}).encode(), KEY, 400, "invalid_value"),
        (completions, json.dumps({"model": MODEL, "prompt": "\ud800"}).encode(), KEY, 400, "invalid_value"),
        (server.url + "/tokenize", json.dumps({"prompt": "\ud800"}).encode(), KEY, 400, "invalid_value"),
        (completions, json.dumps({"model": MODEL, "prompt": "word " * 40_000}).encode(), KEY, 400,
         "context_length_exceeded"),
    ]
    for url, data, key, status, code in cases:
        got, body = post(url, data, key)
        assert (got, body["error"]["code"]) == (status, code), body
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    # issue 39, case 10: a Content-Length larger than the body, then the client goes: one log line
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{}")
        sock.shutdown(socket.SHUT_WR)
        sock.recv(65536)
    deadline = time.monotonic() + 30
    while "incomplete_body" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "incomplete_body" in server.log()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        ask(server.client(api_key="wrong"), "hi")
    with pytest.raises(openai.BadRequestError):
        ask(server.client(), "hi", max_tokens=-1)
    status, body = post(chat, json.dumps(good).encode())
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
    assert "Traceback" not in server.log()


def test_a_grammar_that_fails_mid_generation_gets_a_400_naming_the_param(server):
    """Issue 31, case 2: a schema that compiles, whose second property's regex the grammar library
    cannot build once decoding reaches it. The answer is a 400 naming the param (a stream ends with
    an error event), counted as such in /metrics, and the server goes on."""
    bomb = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2},
                                             "b": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
            "required": ["a", "b"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Give a and b as JSON."}], "max_tokens": 40,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": bomb}}}
    before = server.metrics().get('specx_requests_total{endpoint="chat.completions",status="400"}', 0)
    status, answer = post(server.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == "response_format.json_schema.schema", answer
    assert "failed during generation" in answer["error"]["message"] and len(answer["error"]["message"]) < 1000
    assert server.metrics()['specx_requests_total{endpoint="chat.completions",status="400"}'] == before + 1
    events = server.client().chat.completions.create(**{**body, "stream": True})
    import openai

    with pytest.raises(openai.APIError, match="failed during generation"):
        list(events)
    assert ask(server.client(), "Name a fruit.", 4).choices[0].message.content  # still serving
    assert "Traceback" not in server.log()


def test_models_health_metrics(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:  # no key needed: a readiness probe
        assert json.loads(r.read())["status"] == "ok"
    status, _ = post(server.url + "/v1/models", b"{}")
    assert status == 405
    ask(server.client(), "Name a fruit.", 8)
    with pytest.raises(urllib.error.HTTPError) as err:  # with --api-key, the metrics need it too
        urllib.request.urlopen(server.url + "/metrics", timeout=10)
    assert err.value.code == 401
    m = server.metrics()
    assert m['specx_requests_total{endpoint="chat.completions",status="200"}'] >= 1
    tokens = m['specx_completion_tokens_total{tenant="default"}']
    assert tokens > 0 and m["specx_prompt_tokens_total"] > 0
    assert 0 <= m["specx_cached_prompt_tokens_total"] < m["specx_prompt_tokens_total"]
    assert m['specx_verification_steps_total{tenant="default"}'] >= 1 and "specx_accepted_draft_tokens_total" in m
    assert m["specx_global_index_tokens"] == tokens  # every answer is learned
    assert m["specx_stored_requests_total"] >= 1 and m["specx_queue_depth"] == 0
    assert "specx_tokens_per_second" in m and "specx_accepted_per_step" in m
    lines = re.findall(r"prompt=\d+ \(cached \d+\) tokens=\d+ steps=\d+ accepted=\d+ .* tokens/s=[\d.]+ seconds=",
                       server.log())
    assert len(lines) == m["specx_stored_requests_total"]  # one line per finished request


def test_full_queue_gets_429_and_a_disconnect_frees_the_slot(busy_server):
    import openai

    client = busy_server.client()
    long = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=2000, temperature=0, stream=True)
    next(iter(long))  # decoding: the worker is busy
    statuses: list[object] = []

    def one() -> None:
        try:
            answer = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=4, temperature=0)
            statuses.append(answer.choices[0].text)
        except openai.RateLimitError as err:
            statuses.append(err.status_code)
            assert err.body["code"] == "rate_limit_exceeded"

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while statuses.count(429) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert statuses == [429, 429]  # one waits in the queue (size 1), the others are turned away
    t0 = time.monotonic()
    long.close()  # the client goes away mid-stream: its slot frees, the waiting request runs
    for t in threads:
        t.join(120)
    assert time.monotonic() - t0 < 60  # far less than 2000 tokens of plain decoding
    assert len(statuses) == 3
    assert statuses[2] == client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=4,
                                                    temperature=0).choices[0].text
    metrics = busy_server.metrics()
    assert metrics["specx_cancelled_requests_total"] == 1
    assert metrics['specx_requests_total{endpoint="completions",status="429"}'] == 2


def test_a_client_that_leaves_before_its_answer_frees_the_worker(busy_server):
    import http.client

    before = busy_server.metrics()["specx_cancelled_requests_total"]
    conn = http.client.HTTPConnection("127.0.0.1", busy_server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 2000,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    time.sleep(1.0)  # the worker is decoding its 2000 tokens
    conn.close()  # without reading the (non-streaming) answer
    deadline = time.monotonic() + 30
    while busy_server.metrics()["specx_cancelled_requests_total"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert busy_server.metrics()["specx_cancelled_requests_total"] == before + 1
    answer = busy_server.client().completions.create(model=MODEL, prompt=COUNTING, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


def test_prediction_is_a_draft_and_usage_reports_it(server):
    client = server.client()
    prompt = "Repeat exactly: alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    plain = ask(client, prompt, 40)
    right = ask(client, prompt, 40, prediction={"type": "content", "content": plain.choices[0].message.content})
    wrong = ask(client, prompt, 40, prediction={"type": "content", "content": "def f(x):\n    return x * 2\n" * 3})
    for answer in (right, wrong):  # lossless: the prediction is only a draft
        assert answer.choices[0].message.content == plain.choices[0].message.content
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0.8 * right.usage.completion_tokens
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
