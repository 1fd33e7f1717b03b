"""`specx serve --tenant NAME:KEY`: a real server on loopback, real clients. Each tenant drafts from
its own history and the public corpora only (what another tenant stored or taught never drafts its
requests), the store is followed live (an ingest while serving drafts at once), corpora come and go
over HTTP, and the stream is shaped (one token per event, padded, on a clock). Drafting is read off
the operator's /metrics (verification steps by tenant: fewer steps for the same answer, more drafted).
The scopes and the watcher without a server: test_live_store.py."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import httpx
import pytest

from helpers.cli import specx_in_process
from specx.store.db import Store
from helpers.servers import MODEL, Server, specx_home

KEYS = {"a": "key-a", "b": "key-b", "c": "key-c"}
TENANT_TOKENS = 5_000
OPERATOR = "key-operator"
INTERVAL_MS = 20
PROMPT = "Write a short poem about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    # --fixed-size: whole drafts, so that steps depend on the history alone (not on a learned cost)
    srv = Server(specx_home(tmp_path_factory), tmp_path_factory.mktemp("tenants") / "tenants.db",
                 "--tenant", f"a:{KEYS['a']}", "--tenant", f"b:{KEYS['b']}", "--tenant", f"c:{KEYS['c']}",
                 "--api-key", OPERATOR, "--fixed-size", "--tenant-tokens", str(TENANT_TOKENS),
                 "--stream-interval", str(INTERVAL_MS))
    yield srv
    srv.stop()


def _metrics(srv) -> dict[str, float]:
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def _steps(srv, tenant: str) -> float:
    return _metrics(srv).get(f'specx_verification_steps_total{{tenant="{tenant}"}}', 0.0)


def _complete(srv, tenant: str, prompt: str = PROMPT, tokens: int = 32) -> tuple[str, float, dict]:
    """The answer, the verification steps it took, its body."""
    before = _steps(srv, tenant)
    answer = srv.client(KEYS[tenant]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0)
    return answer.choices[0].message.content, _steps(srv, tenant) - before, answer.model_dump()


def _corpus(srv, method: str, key: str, body=None, name: str = "") -> tuple[int, dict]:
    r = httpx.request(method, srv.url + "/v1/corpus" + (f"/{name}" if name else ""), json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return r.status_code, r.json()


def test_keys_name_tenants_and_the_operator_alone_reads_the_metrics(tenants):
    from openai import AuthenticationError

    with pytest.raises(AuthenticationError):
        tenants.client("key-nobody").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with pytest.raises(AuthenticationError):
        tenants.client(OPERATOR).completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # no tenant's key
    for key in (None, KEYS["a"]):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(tenants.url + "/metrics", headers=headers), timeout=10)
        assert err.value.code == 401
    with urllib.request.urlopen(tenants.url + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok", "models": [MODEL]}  # open to all: the status alone
    for key in (KEYS["a"], OPERATOR):
        req = urllib.request.Request(tenants.url + "/health", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
        assert ("queue_depth" in body) == (key == OPERATOR) and "global_index_tokens" not in body
    assert "tenant a: drafts from" in tenants.log() and "stream: shaped" in tenants.log()
    assert "tenant keys came on the command line" in tenants.log()


def test_tenant_keys_from_a_private_file_or_the_environment_and_an_unpaced_stream_refused(tmp_path):
    from specx.http.auth import read_tenant_file

    path = tmp_path / "tenants"
    path.write_text("# team keys\na:key-from-file-a\n\nb:key-from-file-b\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="others than its owner"):
        read_tenant_file(path)
    path.chmod(0o600)
    assert read_tenant_file(path) == ["a:key-from-file-a", "b:key-from-file-b"]
    path.write_text("a:key-from-file-a\nno colon here\n")
    with pytest.raises(ValueError, match="line 2: write NAME:KEY"):
        read_tenant_file(path)
    # refused before anything loads: with tenants a stream paced at 0 ms would show each step's tokens
    done = specx_in_process("serve", "--tenant", "a:key-zero-a", "--stream-interval", "0", "--port", "1")
    assert done.returncode == 2 and "--stream-interval" in done.stderr
    loose = tmp_path / "loose"
    loose.write_text("a:key-loose-a\n")
    loose.chmod(0o644)
    done = specx_in_process("serve", "--tenant-file", str(loose), "--port", "1")
    assert done.returncode == 2 and "chmod 600" in done.stderr
    done = specx_in_process("serve", "--stream-interval", "0", "--port", "1", env={"SPECX_TENANTS": "a:key-env-a"})
    assert done.returncode == 2 and "--stream-interval" in done.stderr  # the environment's tenants count too


def test_a_tenants_history_never_drafts_another_tenants_request(tenants):
    first, steps_first, body = _complete(tenants, "b")
    again, steps_again, _ = _complete(tenants, "b")  # b's own answer drafts it now
    other, steps_other, _ = _complete(tenants, "a")  # a has never seen it
    assert first == again == other  # lossless in every scope
    assert steps_again < steps_first and steps_other == steps_first
    assert "specx" not in body  # hidden with tenants by default
    assert body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    m = _metrics(tenants)
    assert m['specx_completion_tokens_total{tenant="b"}'] >= 64 and m['specx_completion_tokens_total{tenant="a"}'] >= 32


def test_a_log_ingested_while_serving_drafts_its_tenants_requests_only(tenants, tmp_path):
    prompt = "Describe a quiet morning in a small mountain village."
    plain, steps_plain, _ = _complete(tenants, "a", prompt)  # a's baseline (and a's history from now on)
    log = tmp_path / "b.jsonl"
    log.write_text(json.dumps({"messages": [{"role": "user", "content": prompt}],
                               "response": {"choices": [{"message": {"role": "assistant", "content": plain}}]}}) + "\n")
    total = _metrics(tenants)["specx_global_index_tokens"]
    run = specx_in_process("ingest", str(log), "--tenant", "b", "--db", str(tenants.db))
    assert run.returncode == 0, run.stderr
    deadline = time.monotonic() + 60
    while _metrics(tenants)["specx_global_index_tokens"] <= total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metrics(tenants)["specx_global_index_tokens"] > total, tenants.log()[-2000:]
    text, steps_b, _ = _complete(tenants, "b", prompt)
    assert text == plain and steps_b < steps_plain  # b drafts from the log it just ingested
    assert "store watch: 1 new outputs" in tenants.log()


def test_corpora_come_and_go_over_http_in_the_callers_tenant(tenants):
    prompt = "Explain in two sentences why the sky is blue."
    answer, steps_plain, _ = _complete(tenants, "a", prompt)
    status, made = _corpus(tenants, "POST", KEYS["b"], {"name": "sky", "texts": [answer]})
    assert status == 201 and made["name"] == "sky" and made["texts"] == 1 and made["tokens"] > 0
    assert _corpus(tenants, "GET", KEYS["b"])[1]["data"][0]["name"] == "sky"
    assert _corpus(tenants, "GET", KEYS["a"])[1]["data"] == []  # a does not see b's corpora
    deadline = time.monotonic() + 60
    with_corpus = None
    while time.monotonic() < deadline:  # the watcher hands it over within a poll
        text, steps, _ = _complete(tenants, "b", prompt)
        assert text == answer
        if steps < steps_plain:
            with_corpus = steps
            break
    assert with_corpus is not None
    total = _metrics(tenants)["specx_global_index_tokens"]
    assert _corpus(tenants, "DELETE", KEYS["a"], name="sky")[0] == 404  # not a's to remove
    status, gone = _corpus(tenants, "DELETE", KEYS["b"], name="sky")
    assert status == 200 and gone == {"object": "corpus", "name": "sky", "deleted": True}
    deadline = time.monotonic() + 60  # the rebuilt index is swapped in at the next step, or when idle
    while _metrics(tenants)["specx_global_index_tokens"] > total - made["tokens"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metrics(tenants)["specx_global_index_tokens"] == total - made["tokens"]
    assert _corpus(tenants, "GET", KEYS["b"])[1]["data"] == []


@pytest.mark.parametrize("body, param", [
    ({"name": "bad name", "texts": ["x"]}, "name"),
    ({"name": "x", "texts": []}, "texts"),
    ({"name": "x"}, "texts"),
    ({"name": "x", "texts": ["a"], "token_ids": [[1]]}, "texts"),
    ({"name": "x", "texts": ["a", 3]}, "texts[1]"),
    ({"name": "x", "token_ids": [[1, 10 ** 9]]}, "token_ids[0]"),
    ({"name": "x", "texts": ["a"], "public": True}, "public"),
    ({"name": "x", "texts": ["a"] * 10_001}, "texts"),
])
def test_bad_corpora_are_refused_naming_the_field(tenants, body, param):
    status, error = _corpus(tenants, "POST", KEYS["a"], body)
    assert status == 400 and error["error"]["param"] == param
    assert _corpus(tenants, "POST", "key-nobody", {"name": "x", "texts": ["a"]})[0] == 401


def test_a_huge_corpus_is_refused_by_its_characters_before_it_is_tokenized(tenants):
    """Tokenizing 8M characters holds a core for seconds (and once held the decoding thread's lock,
    freezing every stream): refused by its length first."""
    status, error = _corpus(tenants, "POST", KEYS["a"], {"name": "huge", "texts": ["lighthouse " * 400_000] * 2})
    assert status == 400 and error["error"]["param"] == "texts" and "characters" in error["error"]["message"]
    assert _corpus(tenants, "GET", KEYS["a"])[1]["data"] == []


def test_a_tenants_corpora_are_held_to_its_token_budget_and_write_rate(tenants):
    """Issue 59, hole 9: 100 corpora of 2M tokens each let one tenant index ~200M tokens, and its
    writes (tokenizing, rebuilding) cost every tenant. Now its corpora hold --tenant-tokens together,
    and it writes at most that many a minute (429 past it, saying how long to wait)."""
    def ids(n: int) -> list[list[int]]:
        return [[(7 * i) % 4000 + 10 for i in range(n)]]

    status, made = _corpus(tenants, "POST", KEYS["c"], {"name": "one", "token_ids": ids(3_000)})
    assert status == 201 and made["tokens"] == 3_000
    status, error = _corpus(tenants, "POST", KEYS["c"], {"name": "two", "token_ids": ids(2_500)})
    assert status == 400 and "may keep 5,000" in error["error"]["message"]  # 5,500 together
    r = httpx.post(tenants.url + "/v1/corpus", json={"name": "one", "token_ids": ids(4_900)},
                   headers={"Authorization": f"Bearer {KEYS['c']}"}, timeout=120)  # a replacement fits the budget ...
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1  # ... not the minute's writes (2,000 left)
    assert "tokens a minute" in r.json()["error"]["message"]
    status, made = _corpus(tenants, "POST", KEYS["a"], {"name": "a-own", "token_ids": ids(3_000)})
    assert status == 201  # another tenant's budget and rate are its own
    assert [c["tokens"] for c in _corpus(tenants, "GET", KEYS["c"])[1]["data"]] == [3_000]  # nothing lost
    assert _corpus(tenants, "DELETE", KEYS["a"], name="a-own")[0] == 200


def test_the_shaped_stream_sends_one_padded_token_per_event_on_a_clock(tenants):
    prompt = "Count from one to twenty in words:"
    reference, _, _ = _complete(tenants, "a", prompt)
    events, t0 = [], time.perf_counter()
    with httpx.stream("POST", tenants.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['b']}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as r:
        buf = b""
        for raw in r.iter_raw():
            buf += raw
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                events.append((len(event) + 2, time.perf_counter() - t0, event))
    data = [json.loads(e.split(b"data: ", 1)[1]) for _, _, e in events if b"data: {" in e]
    def text(d):
        return "".join(c["delta"].get("content") or "" for c in d["choices"])

    pieces = [text(d) for d in data if text(d)]
    times = [t for _, t, e in events if b"data: {" in e and text(json.loads(e.split(b"data: ", 1)[1]))]
    usage = next(d["usage"] for d in data if d.get("usage"))
    assert "".join(pieces) == reference  # lossless
    assert all(size % 256 == 0 for size, _, e in events if b"data: {" in e)  # padded: sizes say nothing
    assert usage["completion_tokens"] - 2 <= len(pieces) <= usage["completion_tokens"]  # a token per event
    assert "specx" not in next(d for d in data if d.get("usage"))
    assert times[-1] - times[0] >= (len(times) - 1) * INTERVAL_MS / 1000 * 0.99  # never faster than the clock


def test_a_held_tool_call_waits_its_tokens_slots_on_the_clock(tenants):
    """Issue 59, hole 3: a streamed tool call is held until it is whole, and it left at its raw
    decode time, one slot for all its tokens: a drafted repeat arrived sooner than the clock could
    have sent it. Every token now takes its slot, sent or held."""
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lisbon"]}}, "required": ["city"], "additionalProperties": False}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [weather], "tool_choice": "required", "max_tokens": 48, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    for _ in range(2):  # the second is drafted from the first (a's history): its steps are few
        t0, first, call_at, usage = time.perf_counter(), None, None, None
        with httpx.stream("POST", tenants.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEYS['a']}"}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                first = time.perf_counter() - t0 if first is None else first
                if any(c["delta"].get("tool_calls") for c in d["choices"]) and call_at is None:
                    call_at = time.perf_counter() - t0
                usage = d.get("usage") or usage
    assert call_at is not None and usage["completion_tokens"] >= 8
    assert call_at - first >= (usage["completion_tokens"] - 1) * INTERVAL_MS / 1000 * 0.99


def test_a_server_killed_while_following_an_ingest_loses_nothing(tmp_path_factory, tmp_path):
    """kill -9 while the store is being written and followed: the store is whole (the server only
    reads it then), and the next start drafts from every stored output."""
    from pathlib import Path

    home, db = specx_home(tmp_path_factory), tmp_path / "killed.db"
    srv = Server(home, db)
    srv.client().completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0)
    logs = Path(__file__).parent / "fixtures" / "formats"
    ingest = subprocess.Popen([sys.executable, "-m", "specx", "ingest", str(logs), "--db", str(db)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "SPECX_HOME": home})
    deadline = time.monotonic() + 120
    while "store watch" not in srv.log() and ingest.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.kill()  # SIGKILL: no shutdown, no persisting
    srv.proc.wait()
    ingest.wait(300)
    check = specx_in_process("check", "--db", str(db))
    assert check.returncode == 0, check.stderr
    with Store(db, readonly=True) as store:
        stored = int(store.db.execute("SELECT sum(num_tokens) FROM tokens").fetchone()[0])
    again = Server(home, db, "--api-key", "k")
    try:
        with urllib.request.urlopen(again.url + "/health", timeout=10) as r:
            assert json.loads(r.read())["global_index_tokens"] == stored
    finally:
        again.stop()


def test_a_prompt_another_tenant_sent_is_not_found_in_the_prefix_cache(tenants):
    """Each tenant has a prefix cache of its own: what another sent is prefilled in full (its time
    to the first token would show it otherwise)."""
    prompt = "Zebra inventory note: " + "the lighthouse keeps twelve lamps and four ropes. " * 6  # raw: no template

    def cached(tenant: str) -> int:
        answer = tenants.client(KEYS[tenant]).completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                                 temperature=0)
        return answer.usage.prompt_tokens_details.cached_tokens

    cached("b")
    assert cached("b") > 0  # b's own prompt, found again
    assert cached("a") == 0  # b's, not a's
