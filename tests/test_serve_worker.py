"""`specx serve`'s parts without a server or the real model: the store of served requests
(record_served), and the worker (core/serve/worker.py) on a tiny model, which must answer whatever
a request raises (issue 39). The real server's tests are test_serve.py's."""

import json

import pytest

from specx.core.serve.events import ChoiceDone, Done, Failed
from specx.store.db import Store
from specx.store.formats import Call
from specx.store.index import load_index
from specx.store.served import record_served
from test_serve import MODEL

def test_record_served_stores_a_session_and_its_tokens(tmp_path):
    path = tmp_path / "s.db"
    calls = [Call(session_id="chatcmpl-1", position=i, output_text=f"SELECT {i};",
                  prompt_messages=[{"role": "user", "content": "q"}], model=MODEL, started_at="2025-01-01T00:00:00",
                  ended_at="2025-01-01T00:00:01", meta={"steps": 3}) for i in range(2)]
    with Store(path) as store:
        rowids = record_served(store, MODEL, calls, [[1, 2, 3], [1, 2, 4, 2]], "fp", MODEL, 1000)
        tokenizer_id = store.tokenizer_id("fp")
        assert rowids == [r for r, _ in store.iter_tokens(tokenizer_id)]  # the rows it wrote
        record_served(store, MODEL, [Call(session_id="cmpl-2", position=0, output_text="x", prompt_text="p",
                                          model=MODEL)], [[7]], "fp", MODEL, 1000)
        stats = store.stats()
        assert (stats["sessions"], stats["calls"]) == (2, 3)
        assert stats["by_format"] == [{"format": "served", "sources": 1, "calls": 3, "raw_bytes": 0}]
        rows = [t.tolist() for _, t in store.iter_tokens(tokenizer_id)]
        assert rows == [[1, 2, 3], [1, 2, 4, 2], [7]]
        first = store.db.execute("SELECT id, meta, started_at FROM calls ORDER BY id").fetchone()
        assert store.call_prompt(first[0]) == [{"role": "user", "content": "q"}]
        assert store.call_output(first[0]) == "SELECT 0;" and json.loads(first[1]) == {"steps": 3}
        index = load_index(store, tokenizer_id)
        assert index.num_tokens == 8
        assert store.index_state(tokenizer_id).num_calls == 3  # persisted


# --------------------------------------------------------------------------- fast: the worker on a tiny model (issue 39)

class CharTokenizer:
    """Token i is one letter; 0 is EOS."""

    eos_token_id = 0

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def encode(self, text, **kwargs):
        return [ord(c) % 97 for c in text]


class IndexSize:
    num_tokens = 0


def tiny_worker(recorder=None):
    from specx.core.decode.stack import Stack
    from specx.core.model.hf_engine import TransformersEngine
    from specx.core.serve.worker import Worker
    from test_verify import tiny_model

    return Worker(Stack(TransformersEngine(tiny_model()), CharTokenizer(), "chars", IndexSize()), recorder=recorder)


def tiny_request(**kwargs):
    from specx.core.serve.job import GenerationRequest

    return GenerationRequest(id="chatcmpl-test", endpoint="chat.completions", model=MODEL, prompt_ids=[5, 6, 7],
                             max_tokens=4, prompt_messages=[{"role": "user", "content": "q"}], temperature=0.0,
                             **kwargs)


def answer(worker, *requests, timeout=60.0):
    """Each request's events, sent one after the other to the running worker, up to its last
    (Done or Failed); asyncio.TimeoutError when one never ends (a dead worker)."""
    import asyncio

    from specx.core.serve.job import Job

    async def run():
        out = []
        for req in requests:
            job = Job(req, asyncio.get_running_loop())
            worker.submit(job)
            events = []
            while not events or not isinstance(events[-1], (Done, Failed)):
                events.append(await asyncio.wait_for(job.events.get(), timeout))
            out.append(events)
        return out

    return asyncio.run(run())


def test_a_request_the_store_cannot_take_is_answered_and_the_worker_goes_on(tmp_path, caplog):
    """Issue 39, case 1: a stop string holding a lone surrogate made ServedRecorder.record raise
    UnicodeEncodeError, which ended the worker thread: that request and every later one hung."""
    from specx.store.served import ServedRecorder
    from test_verify import VOCAB

    worker = tiny_worker(ServedRecorder(tmp_path / "s.db", MODEL, "fp", VOCAB, False))
    worker.start()
    try:
        first, second = answer(worker, tiny_request(stop=["\ud800"]), tiny_request())
        assert [type(e) for e in first][-2:] == [ChoiceDone, Done] and isinstance(second[-1], Done)
        assert worker.alive
    finally:
        worker.stop()
    assert "could not store the request" in caplog.text
    with Store(tmp_path / "s.db") as store:
        assert store.stats()["calls"] == 1  # the second


def test_whatever_a_request_raises_the_worker_answers_the_next(monkeypatch, caplog):
    """Issue 39, case 1: any exception a request raises (in the recorder, after decoding) ends
    that request with an error event, or still sends its answer, and the worker goes on."""

    class Broken:
        def open(self):
            pass

        def record(self, *args):
            raise KeyError("the recorder broke")

        def persist(self):
            raise RuntimeError("the index broke")

        def close(self):
            pass

    worker = tiny_worker(Broken())
    observe = worker.metrics.observe
    calls = []

    def observe_once_broken(stats, tenant=""):
        calls.append(stats)
        if len(calls) == 1:
            raise ZeroDivisionError("a bug after decoding")
        observe(stats, tenant)

    monkeypatch.setattr(worker.metrics, "observe", observe_once_broken)
    worker.start()
    try:
        broken, recorded = answer(worker, tiny_request(), tiny_request())
        assert broken[-1].status == 500 and "ZeroDivisionError" in broken[-1].message
        assert isinstance(recorded[-1], Done)  # the recorder raised: logged, and the answer still went out
        assert worker.alive
    finally:
        worker.stop()
    assert "ZeroDivisionError: a bug after decoding" in caplog.text and "the recorder broke" in caplog.text


def test_health_is_503_with_the_reason_when_the_worker_is_gone(monkeypatch):
    """Issue 39, case 1: with the worker thread dead, /health said 200 "ok" and requests queued
    for ever. Now /health is 503 with the reason, the request that ended it and later ones get a 503."""
    import asyncio

    from specx.cli.http.app import Api
    from specx.core.serve.metrics import Metrics

    class Bug(BaseException):  # what nothing catches: only a bug in the worker itself
        pass

    def crash(job, stack):
        raise Bug("a bug in the worker")

    worker = tiny_worker()
    api = Api(Metrics(), [MODEL])
    api.ready(worker, 64)
    assert asyncio.run(api.health(None)).status_code == 200
    monkeypatch.setattr(worker, "_answer", crash)
    (events,) = answer(worker, tiny_request())
    assert events[-1].status == 503 and "a bug in the worker" in events[-1].message
    worker._thread.join(10)
    health = asyncio.run(api.health(None))
    body = json.loads(health.body)
    assert health.status_code == 503 and body["status"] == "unhealthy" and "a bug in the worker" in body["reason"]
    with pytest.raises(RuntimeError, match="worker has stopped"):
        answer(worker, tiny_request())
