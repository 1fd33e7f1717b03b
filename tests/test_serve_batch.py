"""Batching in `specx serve` (core/serve/batch.py, issue 46): concurrent requests share each
forward pass of the quantized engine, and each gets what it gets alone, token for token.

The worker tests run the built-in model's GGUF in this process (its kernels compile once, ~15 s);
the slow test starts a real server and sends concurrent requests through the openai client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from specx.core.cost.sizing import size_draft
from specx.core.decode.request import Decoding
from specx.core.draft import Draft
from specx.core.serve.batch import Batcher
from specx.core.serve.events import ChoiceDone, Delta, Done, Failed
from specx.core.serve.job import GenerationRequest, Job
from specx.core.serve.request_view import fork_drafter

SYSTEM = ("You write SQLite queries for this schema.\nCREATE TABLE singer (singer_id, name, country, age);\n"
          "CREATE TABLE concert (concert_id, concert_name, theme, stadium_id, year);\n"
          "Question: How many singers are there?\n```sql\nSELECT count(*) FROM singer;\n```\n")


@pytest.fixture(scope="module")
def stack():
    from specx.stack import assemble

    return assemble("smollm2-135m", backend="quantized", dtype=None, say=lambda m: None, prefix_cache_tokens=8192)


@pytest.fixture(scope="module")
def vocabulary(stack):
    from specx.core.decode.grammar import Vocabulary

    tok = stack.tokenizer
    return Vocabulary(tok, stack.engine.vocab_size, tok.eos_token_id)


def chat(stack, question: str, system: str = SYSTEM) -> list[int]:
    ids = stack.tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                              add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def requests(stack) -> list[GenerationRequest]:
    """Different lengths, samplers, stops, a grammar, two choices; most share the system prompt."""
    from specx.core.decode.grammar import json_schema_grammar

    schema = {"type": "object", "properties": {"sql": {"type": "string"}}, "required": ["sql"]}

    eos = stack.tokenizer.eos_token_id

    def req(i: int, question: str, n: int = 1, grammar_param: str | None = None, **kw) -> GenerationRequest:
        settings = Decoding(**{"max_new_tokens": 40, "eos_token_ids": eos, **kw})
        return GenerationRequest(id=f"r{i}", endpoint="chat.completions", model="m", prompt_ids=chat(stack, question),
                                 settings=settings, n=n, grammar_param=grammar_param)

    return [req(0, "List the names of singers from France."),
            req(1, "What is the average age of singers?", max_new_tokens=6),
            req(2, "Which concerts were held in 2014?", temperature=0.8, top_p=0.9, seed=7),
            req(3, "Show every theme of concerts.", stop=["FROM"]),
            req(4, "Count the concerts per year.", grammar=json_schema_grammar(schema), grammar_param="response_format"),
            req(5, "Name the oldest singer.", n=2, temperature=0.7, seed=3, max_new_tokens=24),
            GenerationRequest(id="r6", endpoint="completions", model="m", prompt_text="SELECT",
                              prompt_ids=stack.tokenizer.encode("SELECT name FROM singer WHERE"),
                              settings=Decoding(max_new_tokens=30, eos_token_ids=eos))]


def run(worker, reqs, *, at_once: bool, cancel: set[str] = frozenset()):
    """Each request's (choices' tokens, last event); at once or one after the other; a request in
    `cancel` is cancelled after its first delta."""
    async def one(req):
        job = Job(req, asyncio.get_running_loop())
        worker.submit(job)
        tokens: dict[int, list[int]] = {}
        for _ in range(3000):
            try:
                event = await asyncio.wait_for(job.events.get(), 0.1)
            except asyncio.TimeoutError:  # a cancelled job ends without an answer: once the worker let it go
                if job.cancelled.is_set() and job not in worker._running:
                    return None, None
                continue
            if isinstance(event, Delta) and req.id in cancel:
                job.cancelled.set()
            if isinstance(event, ChoiceDone):
                tokens[event.choice.index] = event.choice.token_ids
            if isinstance(event, (Done, Failed)):
                return [tokens[i] for i in sorted(tokens)], event
        raise AssertionError(f"{req.id} was never answered")

    async def main():
        if at_once:
            return await asyncio.gather(*(one(r) for r in reqs))
        return [await one(r) for r in reqs]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def alone(stack, vocabulary):
    """The requests answered one at a time (--max-batch 1): the reference."""
    from specx.core.serve.worker import Worker

    worker = Worker(stack, max_batch=1, vocabulary=vocabulary)
    worker.start()
    try:
        assert not worker.batched
        return run(worker, requests(stack), at_once=False)
    finally:
        worker.stop()


def test_concurrent_requests_get_what_they_get_alone_and_share_passes(stack, vocabulary, alone):
    from prometheus_client import generate_latest

    from specx.core.serve.worker import Worker

    worker = Worker(stack, max_batch=8, vocabulary=vocabulary)
    worker.start()
    try:
        assert worker.batched
        together = run(worker, requests(stack), at_once=True)
    finally:
        worker.stop()
    for (want, _), (got, event) in zip(alone, together):
        assert isinstance(event, Done) and got == want
    assert together[4][0][0]  # the grammar-bound answer is there
    steps = sum(e.stats.decode.steps for _, e in together)
    batcher = worker.batcher
    assert batcher.passes < steps  # requests shared passes (prefill chunks are passes too)
    scrape = generate_latest(worker.metrics.registry).decode()
    assert "specx_running_requests 0.0" in scrape
    per_pass = float(next(line.split()[1] for line in scrape.splitlines() if line.startswith("specx_tokens_per_pass")))
    assert per_pass == pytest.approx(batcher.rows / batcher.passes) and per_pass > 2


def test_a_request_that_fails_or_is_cancelled_leaves_the_others_unchanged(stack, vocabulary, alone):
    """One prompt holds a token the model has not (its prefill pass fails): it is answered 500,
    one is cancelled by its client after its first delta; the rest finish as they do alone."""
    from specx.core.serve.worker import Worker

    reqs = requests(stack)
    bad = GenerationRequest(id="bad", endpoint="completions", model="m", prompt_text="?",
                            prompt_ids=[1, 2, stack.engine.vocab_size + 5],
                            settings=Decoding(max_new_tokens=8, eos_token_ids=stack.tokenizer.eos_token_id))
    worker = Worker(stack, max_batch=8, vocabulary=vocabulary)
    worker.start()
    try:
        results = run(worker, [*reqs, bad], at_once=True, cancel={"r0"})
        assert worker.alive
    finally:
        worker.stop()
    *good, (_, failed) = results
    assert isinstance(failed, Failed) and failed.status == 500
    for req, (want, _), (got, event) in zip(reqs, alone, good):
        if req.id == "r0":
            assert not isinstance(event, Done)  # cancelled: no answer, nothing stored
            continue
        assert isinstance(event, Done) and got == want, req.id


def test_prompts_sharing_a_prefill_in_flight_prefill_it_once(stack):
    """Agents fanning out send one long system prompt at once: the later requests wait for the
    first one's prefill and copy it from the prefix cache."""
    from specx.core.serve.worker import Worker

    system = SYSTEM * 4
    settings = Decoding(max_new_tokens=4, eos_token_ids=stack.tokenizer.eos_token_id)
    reqs = [GenerationRequest(id=f"s{i}", endpoint="chat.completions", model="m", settings=settings,
                              prompt_ids=chat(stack, q, system)) for i, q in enumerate(("Count singers.", "Count concerts.",
                                                                                         "List themes."))]
    shared = next(i for i, (a, b) in enumerate(zip(reqs[0].prompt_ids, reqs[1].prompt_ids)) if a != b)
    worker = Worker(dataclasses.replace(stack, prefix_cache=stack.engine.new_prefix_cache(8192)), max_batch=4)
    worker.start()
    try:
        results = run(worker, reqs, at_once=True)
    finally:
        worker.stop()
    assert all(isinstance(e, Done) for _, e in results)
    assert sum(e.stats.cached_tokens for _, e in results) >= 2 * (shared - 1)
    prompt_rows = sum(len(r.prompt_ids) - 1 for r in reqs)
    assert worker.batcher.prefill_rows <= prompt_rows - 2 * (shared - 1)


def test_a_node_is_kept_only_while_it_beats_the_rate_of_the_whole_pass():
    """size_draft with other requests in the pass: the same tree is cut shorter when the pass
    already emits many tokens (the node's chance must beat the pass's tokens per second times
    the time it adds), and left whole when it is alone on a flat curve."""
    draft = Draft([5, 6, 7, 8], [-1, 0, 1, 2], [0.9, 0.6, 0.4, 0.3], 2.2, 4)

    def line(n, context=None):
        return 10.0 + 1.0 * n

    assert len(size_draft(draft, line, 1)) == 4  # alone: 3.2 tokens in 15 units beat 2.9 in 14
    assert len(size_draft(draft, line, 1, others=(7, 7.0))) == 2  # beside 7 others: 9.5 in 20 beats 8 in 18 and 9.9 in 21


def test_the_batch_cost_line_is_fitted_to_the_shared_passes():
    class Model:  # a pass costs 2 ms + 0.5 ms per row, exactly: what the line must find
        tuner = None  # no threads chosen

        def forward_batch(self, parts):
            return [None for _ in parts]

    batcher = Batcher(Model())
    clock = iter(np.cumsum([v for rows in [3, 9, 5, 20, 7, 12, 30, 4, 16, 10] for v in (0.0, 0.002 + 0.0005 * rows)]))
    import specx.core.serve.batch as batch

    real = batch.time.perf_counter
    batch.time.perf_counter = lambda: float(next(clock))
    try:
        for rows in [3, 9, 5, 20, 7, 12, 30, 4, 16, 10]:
            members = [batcher.join(), batcher.join()]
            for m, n in zip(members, (1, rows - 1)):
                m.part = (type("KV", (), {"length": 100})(), [0] * n, None, None, np.arange(n))
            batcher.step(members)
            for m in members:
                batcher.leave(m)
    finally:
        batch.time.perf_counter = real
    base, slope = batcher.line()
    assert base == pytest.approx(0.002, rel=1e-6) and slope == pytest.approx(0.0005, rel=1e-6)


def test_a_forked_drafter_keeps_its_own_request_and_shares_the_index():
    from specx.core.decode.speculate import SuffixDrafter
    from specx.core.index.suffix_index import SuffixIndex

    drafter = SuffixDrafter(SuffixIndex.build([[5, 6, 7, 8]]))
    a, b = fork_drafter(drafter), fork_drafter(drafter)
    a.start_request([1, 5, 6])
    b.start_request([2, 7])
    assert a.speculate().token_ids == [7, 8] and b.speculate().token_ids == [8]
    a.extend([9, 9])
    a.finish_request()
    assert a.global_index is b.global_index is drafter.global_index and drafter.global_index.num_tokens > 4
    assert b.speculate().token_ids == [8]  # its request is untouched by a's


@pytest.mark.slow
def test_a_real_server_batches_concurrent_openai_clients(tmp_path, tmp_path_factory):
    """`specx serve --backend quantized`: four clients at once get the texts one client gets, and
    /metrics shows the passes they shared."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers.servers import Server

    from helpers.cli import specx_test_home

    questions = ["How many singers are there?", "List all concert names.", "What is the oldest age?",
                 "Show the themes of 2014 concerts.", "Count concerts per stadium.", "Name singers from France."]
    srv = Server(str(specx_test_home(tmp_path_factory)), tmp_path / "served.db", "--backend", "quantized",
                 "--max-batch", "4")
    try:
        client = srv.client()

        def ask(q: str) -> str:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32, temperature=0)
            return out.choices[0].message.content

        one = [ask(q) for q in questions]
        with ThreadPoolExecutor(4) as pool:
            four = list(pool.map(ask, questions))
        metrics = srv.metrics()
    finally:
        srv.stop()
    assert four == one
    assert metrics["specx_running_requests"] == 0 and metrics["specx_tokens_per_pass"] > 1
    # the passes' own figures (what `specx bench tasks` reads to say how busy the model was)
    prefill, step = metrics['specx_forward_rows{kind="prefill"}'], metrics['specx_forward_rows{kind="step"}']
    assert metrics["specx_forward_passes"] >= 1 and metrics["specx_forward_seconds"] > 0
    assert prefill > 0 and step > 0
    assert (prefill + step) / metrics["specx_forward_passes"] == pytest.approx(metrics["specx_tokens_per_pass"])
    assert "up to 4 requests share each forward pass" in srv.log()


def test_the_worker_thread_serves_while_request_threads_wait():  # the baton is free while a pass runs
    class Model:
        tuner = None

        def forward_batch(self, parts):
            assert not batcher.baton.locked()
            return [np.zeros(1) for _ in parts]

    batcher = Batcher(Model())
    member = batcher.join()
    out = []

    def request():
        with batcher.baton:
            out.append(batcher.run(member, (type("KV", (), {"length": 0})(), [1], None, None, np.arange(1))))
            batcher.leave(member)

    thread = threading.Thread(target=request)
    thread.start()
    members = batcher.ready(timeout=10)
    batcher.step(members)
    thread.join(10)
    assert members == [member] and len(out) == 1


def test_shutdown_cuts_every_running_request_short_and_turns_the_queued_away(stack, vocabulary):
    """SIGTERM (shutdown_begins) while several requests share the passes: each running one is
    answered 503 "cut short" at its next step, the queued ones 503, and the worker thread ends
    (not spinning: it waits for the running ones' steps)."""
    from specx.core.serve.worker import Worker

    worker = Worker(stack, max_batch=2, vocabulary=vocabulary)
    worker.start()
    reqs = requests(stack)[:4]
    started = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(r, loop) for r in reqs]
        for job in jobs:
            worker.submit(job)
        finals = []
        for job in jobs:
            while True:
                event = await asyncio.wait_for(job.events.get(), 300)
                if isinstance(event, Delta) and not started.is_set():
                    started.set()
                    worker.shutdown_begins()
                if isinstance(event, (Done, Failed)):
                    finals.append(event)
                    break
        return finals

    finals = asyncio.run(main())
    worker.stop()
    assert not worker._thread.is_alive()
    cut = [e for e in finals if isinstance(e, Failed)]
    assert all(e.status == 503 and "shutting down" in e.message for e in cut)
    assert any("cut short" in e.message for e in cut) and len(cut) >= 3  # the first one's batch-mate may finish


class _ChunkedEngine:
    """An engine whose prefill is one pass per CHUNK prompt tokens (what QuantEngine.start_steps
    yields), on a fake model: enough of one for BatchedEngine.start."""

    CHUNK = 16
    name, vocab_size, context_length, precision, kernels = "chunked", 100, 4096, "none", []
    tree_unsupported, device, prompt_lookup, cost_curve, tuner = None, "cpu", False, "cpu", None

    def forward_batch(self, parts):
        return [np.zeros((len(p[4]), 1), dtype=np.float32) for p in parts]

    def start_steps(self, tokens, prefix_cache=None):
        kv = type("KV", (), {"length": 0, "reused": 0})()
        for start in range(0, len(tokens), self.CHUNK):
            yield kv, list(tokens[start : start + self.CHUNK]), None, None, np.arange(1)
            kv.length += len(tokens[start : start + self.CHUNK])
        return type("Session", (), {"kv": kv, "reused": 0})()


def _prefill_two(a_cache, b_cache) -> dict[str, object]:
    """a's 200-token prompt starts prefilling; then b's 120-token prompt, its first 100 tokens a's,
    starts on `b_cache` (a's is `a_cache`). The test's thread runs the passes (batcher.ready, step)
    until both prompts are in: what b saw when its prefill ended (a's still in flight or not, the
    passes so far), and whether b was ever parked. Nothing here depends on timing: a pass runs only
    once every member that is not parked has put its part in."""
    from specx.core.serve.request_view import BatchedEngine

    engine = _ChunkedEngine()
    batcher = Batcher(engine)
    a_prompt = list(range(1, 201))
    b_prompt = a_prompt[:100] + [99] * 20
    seen: dict[str, object] = {"b_parked": False}
    a, b = batcher.join(), None

    def prefill(member, prompt, cache, name):
        with batcher.baton:
            BatchedEngine(engine, batcher, member).start(prompt, cache)
            if name == "b":
                seen["a_in_flight"] = a in batcher.prefilling
                seen["b_passes"] = batcher.passes
            else:
                seen["a_passes"] = batcher.passes
            batcher.leave(member)

    threads = [threading.Thread(target=prefill, args=(a, a_prompt, a_cache, "a"), daemon=True)]
    threads[0].start()
    batcher.step(batcher.ready(timeout=30))  # a's first chunk: a is in flight
    assert a in batcher.prefilling
    b = batcher.join()
    threads.append(threading.Thread(target=prefill, args=(b, b_prompt, b_cache, "b"), daemon=True))
    threads[1].start()
    for _ in range(100):
        if not any(t.is_alive() for t in threads):
            break
        members = batcher.ready(timeout=1)
        seen["b_parked"] = seen["b_parked"] or b.parked
        if members:
            batcher.step(members)
    for t in threads:
        t.join(10)
    assert "a_passes" in seen and "b_passes" in seen
    return seen


def test_a_tenant_never_waits_behind_another_tenants_prefill_in_flight():
    """Issue 59, hole 1: with tenants each has a prefix cache of its own, so a prompt that starts
    like another tenant's prompt being prefilled gains nothing by waiting for it, and its wait
    (6.8-16.9 s against 0.96-1.82 s) told its client what the other had sent. b's prompt (120
    tokens, 100 of them a's) is prefilled beside a's (200 tokens) and ends first; on one cache (one
    tenant) b still waits for a's prefill and copies it."""
    from specx.core.model.prefix_cache import PrefixCache

    tenants = _prefill_two(PrefixCache(4096), PrefixCache(4096))
    assert not tenants["b_parked"]
    assert tenants["a_in_flight"] and tenants["b_passes"] < tenants["a_passes"]
    shared = PrefixCache(4096)
    one = _prefill_two(shared, shared)
    assert one["b_parked"] and not one["a_in_flight"] and one["b_passes"] > one["a_passes"]


def test_a_prefill_too_long_for_its_cache_is_not_waited_for():
    """A prompt the cache cannot store (longer than its budget) fills nothing: a prompt sharing
    its start gains nothing by waiting for it."""
    from specx.core.model.prefix_cache import PrefixCache

    small = PrefixCache(150)  # a's 200 tokens do not fit; b's 120 do
    seen = _prefill_two(small, small)
    assert not seen["b_parked"] and seen["a_in_flight"]
