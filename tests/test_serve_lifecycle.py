"""`specx serve` servers started for one test each: a restart that drafts from what was served,
start options (/tokenize, CORS, --max-model-len) and refusals in the log, SIGTERM mid-stream, the
port open while loading. The shared helpers (Server, post, ask) are tests/helpers/servers.py's."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specx.store.db import Store

from helpers.servers import COUNTING, MODEL, Server, ask, free_port, post, specx_home


@pytest.mark.slow
def test_restarted_server_drafts_from_what_it_served(tmp_path, tmp_path_factory):
    home = specx_home(tmp_path_factory)
    db = tmp_path / "warm.db"
    question = "Write a SQL query that lists every singer older than 30, ordered by name."
    first = Server(home, db, "--fixed-size", "--max-spec-tokens", "8")  # no calibration: quick start
    try:
        cold = ask(first.client(), question, 24).model_extra["specx"]
    finally:
        assert first.stop() in (0, -signal.SIGTERM)
    assert "index persisted" in first.log()
    with Store(db) as store:
        (tokenizer_id,) = store.db.execute("SELECT id FROM tokenizers").fetchone()
        assert store.index_state(tokenizer_id).num_calls == store.token_rows(tokenizer_id)[0] == 1
        (call_id,) = store.db.execute("SELECT id FROM calls").fetchone()
        assert store.call_prompt(call_id) == [{"role": "user", "content": question}]
        meta = json.loads(store.db.execute("SELECT meta FROM calls").fetchone()[0])
        assert meta["steps"] == cold["steps"] and meta["endpoint"] == "chat.completions"
    second = Server(home, db, "--fixed-size", "--max-spec-tokens", "8")
    try:
        warm_answer = ask(second.client(), question, 24)
        warm = warm_answer.model_extra["specx"]
        assert warm_answer.choices[0].message.content == store_output(db, call_id)
    finally:
        second.stop()
    assert warm["global_index_tokens"] == 2 * cold["global_index_tokens"] > 0  # loaded + learned again
    assert warm["accepted"] > cold["accepted"] + 8 and warm["steps"] < cold["steps"]


def store_output(db: Path, call_id: int) -> str:
    with Store(db) as store:
        return store.call_output(call_id)


@pytest.mark.slow
def test_tokenize_detokenize_cors_max_model_len_and_refusals_logged(tmp_path, tmp_path_factory):
    srv = Server(specx_home(tmp_path_factory), tmp_path / "t.db", "--no-speculation", "--max-model-len", "256",
                 "--allowed-origins", "http://agent.example")
    try:
        status, body = post(srv.url + "/tokenize", json.dumps({"model": MODEL, "prompt": "SELECT name FROM singer"}).encode())
        assert status == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 256
        status, back = post(srv.url + "/detokenize", json.dumps({"model": MODEL, "tokens": body["tokens"]}).encode())
        assert status == 200 and back["prompt"] == "SELECT name FROM singer"
        messages = [{"role": "user", "content": "hi"}]
        _, chat = post(srv.url + "/tokenize", json.dumps({"model": MODEL, "messages": messages}).encode())
        answer = srv.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert chat["count"] == answer.usage.prompt_tokens  # what the completion endpoint feeds the model
        _, bare = post(srv.url + "/tokenize", json.dumps({"messages": messages, "add_generation_prompt": False}).encode())
        assert bare["count"] < chat["count"]
        for path, payload, code in (("/detokenize", {"tokens": [10**9]}, "invalid_value"),
                                    ("/detokenize", {"tokens": "abc"}, "invalid_type"),
                                    ("/detokenize", {"tokens": [1] * 257}, "context_length_exceeded"),  # issue 47
                                    ("/tokenize", {"model": "gpt-4o", "prompt": "x"}, "model_not_found"),
                                    ("/tokenize", {}, "missing_required_parameter")):
            status, body = post(srv.url + path, json.dumps(payload).encode())
            assert status in (400, 404) and body["error"]["code"] == code, body
        status, body = post(srv.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 300}).encode())
        assert (status, body["error"]["code"]) == (400, "context_length_exceeded")  # 256, not the model's 8192
        preflight = urllib.request.Request(srv.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://agent.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        with urllib.request.urlopen(preflight, timeout=10) as r:
            assert r.status == 200 and r.headers["access-control-allow-origin"] == "http://agent.example"
        other = urllib.request.Request(srv.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"})
        with pytest.raises(urllib.error.HTTPError):  # an origin not allowed: the preflight fails
            urllib.request.urlopen(other, timeout=10)
        log = srv.log()
        assert "refused completions: 400 context_length_exceeded" in log
        assert "refused detokenize: 400 invalid_value (param tokens)" in log and "Traceback" not in log
    finally:
        srv.stop()
    too_long = subprocess.run([sys.executable, "-m", "specx", "serve", "--no-speculation", "--port", str(free_port()),
                               "--db", str(tmp_path / "u.db"), "--max-model-len", "100000"], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "SPECX_HOME": specx_home(tmp_path_factory)})
    assert too_long.returncode == 2 and "--max-model-len" in too_long.stderr and "Traceback" not in too_long.stderr


@pytest.mark.slow
def test_sigterm_ends_the_stream_in_flight_properly_and_persists(tmp_path, tmp_path_factory):
    import http.client

    srv = Server(specx_home(tmp_path_factory), tmp_path / "s.db", "--no-speculation")
    try:
        ask(srv.client(), "Name a fruit.", 4)  # one stored answer: the index has something to persist
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 2000,
                                                            "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        events = []
        while len(events) < 5:  # decoding has begun
            line = response.readline().decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
        srv.proc.send_signal(signal.SIGTERM)
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
        log = srv.log()
        assert "shutting down" in log and "index persisted" in log and "Traceback" not in log
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_port_opens_at_once_and_health_says_loading_until_ready(tmp_path, tmp_path_factory):
    port = free_port()
    env = {**os.environ, "SPECX_HOME": specx_home(tmp_path_factory)}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specx", "serve", "--port", str(port), "--db",
                                 str(tmp_path / "l.db")], stdout=log, stderr=subprocess.STDOUT, env=env)
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and 200 not in seen:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    seen.append(r.status)
            except urllib.error.HTTPError as err:
                body = json.loads(err.read())
                assert err.code == 503 and body["status"] == "loading" and body["stage"], body
                seen.append(503)
                status, answer = post(f"http://127.0.0.1:{port}/v1/completions",
                                      json.dumps({"model": MODEL, "prompt": "hi"}).encode(), None)
                assert status in (200, 503)  # loading: 503 model_loading, never a hang or a 500
                if status == 503:
                    assert answer["error"]["code"] == "model_loading"
            except OSError:
                time.sleep(0.05)  # not listening yet
        assert seen and seen[0] == 503 and seen[-1] == 200, seen
        text = log_path.read_text()
        assert text.index("listening on") < text.index("ready: serving")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    bad = subprocess.run([sys.executable, "-m", "specx", "serve", "--port", str(free_port()), "--db",
                          str(tmp_path / "b.db"), "--model", str(tmp_path / "no-such-model")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert bad.returncode == 1 and "no-such-model" in bad.stderr and "Traceback" not in bad.stderr
