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
from helpers.servers import MODEL

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
    from specx.core.model.transformers.engine import TransformersEngine
    from specx.core.serve.worker import Worker
    from helpers.models import tiny_model

    return Worker(Stack(TransformersEngine(tiny_model()), CharTokenizer(), "chars", IndexSize()), recorder=recorder)


def tiny_request(tenant: str = "", **settings):
    from specx.core.decode.request import Decoding
    from specx.core.serve.job import GenerationRequest

    return GenerationRequest(id="chatcmpl-test", endpoint="chat.completions", model=MODEL, prompt_ids=[5, 6, 7],
                             settings=Decoding(max_new_tokens=4, eos_token_ids=CharTokenizer.eos_token_id, **settings),
                             prompt_messages=[{"role": "user", "content": "q"}], tenant=tenant)


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
    from helpers.models import VOCAB

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

    from specx.http.app import Api
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


def test_a_tenants_losing_drafts_leave_another_tenants_drafting_as_it_was():
    """Issue 59, hole 6: one acceptance model and one draft guard served every tenant, so b's
    losing drafts shrank or switched off a's (its stream's pace showed b's history). Each tenant
    now learns its own (the pass-cost curve stays shared: it measures the machine)."""
    from specx.core.cost.forward import ForwardCost
    from specx.core.cost.guard import GUARD_STEPS
    from specx.core.cost.learned import LearnedCost
    from specx.core.decode.speculate import SuffixDrafter
    from specx.core.decode.stack import Stack
    from specx.core.index.suffix_index import SuffixIndex
    from specx.core.model.transformers.engine import TransformersEngine
    from specx.core.serve.scopes import Scopes
    from specx.core.serve.worker import Worker
    from helpers.models import tiny_model

    indexes = {"a": SuffixIndex(), "b": SuffixIndex()}
    cost = LearnedCost(ForwardCost((1, 4, 16), (0.01, 0.011, 0.013)))
    worker = Worker(Stack(TransformersEngine(tiny_model()), CharTokenizer(), "chars", SuffixIndex(),
                          drafter=SuffixDrafter(SuffixIndex()), cost=cost), scopes=Scopes(indexes, tenants=True))
    worker.start()
    try:
        [plain] = answer(worker, tiny_request(tenant="a"))
        tokens = [e for e in plain if isinstance(e, ChoiceDone)][0].choice.token_ids
        # b's history continues b's prompt otherwise than the model does: b's drafts lose
        indexes["b"].add([5, 6, 7] + [(t + 1) % 97 for t in tokens])
        for _ in range(3):
            [events] = answer(worker, tiny_request(tenant="b"))
            assert [e for e in events if isinstance(e, ChoiceDone)][0].choice.token_ids == tokens  # lossless
        a, b = worker._drafting_of("a"), worker._drafting_of("b")
        assert b.acceptance.tried.sum() > 0 and b.acceptance.accepted.sum() < b.acceptance.tried.sum()
        assert a.acceptance.tried.sum() == 0  # a's drafts are sized as if b had never drafted
        for _ in range(GUARD_STEPS):  # b's drafts cost twice what plain decoding would: b's guard caps them
            b.cost.guard.observe_priced(0.02, 0.01, 1, 8)
        assert b.cost.max_draft() is not None and a.cost.max_draft() is None  # a's drafts uncapped
        assert a.cost.curve is b.cost.curve is cost.curve  # one curve: the machine's
    finally:
        worker.stop()
