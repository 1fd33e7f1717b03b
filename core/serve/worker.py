"""The thread that owns the model for `specx serve`: requests from a bounded queue, up to
`max_batch` of them decoded together (core/serve/batch.py: they share each forward pass), or one
at a time where the engine's passes cannot be batched (transformers, llama.cpp) or max_batch is 1.

The HTTP side (cli/http/app.py) validates a request, wraps it in a Job and submits it; a full
queue raises queue.Full (HTTP 429). The worker decodes it with the same loop as `specx generate`
(core.decode.generate with a SuffixDrafter over the global index) and sends typed events back to
the event loop through `loop.call_soon_threadsafe` into the job's asyncio.Queue (events.py: a
Delta of new text per step, a ChoiceDone per choice, then Done with the request's Stats; or Failed
with an HTTP status, a message and the request's parameter at fault).

A choice decodes and streams in core/serve/choice_stream.py. A client that goes away sets
`job.cancelled`; the worker checks it between verification steps and closes the decode loop,
which ends the request without learning from it (a batched request leaves the batch; the others go
on). A finished request goes to the worker's Keeper (core/serve/keeper.py: its Recorder stores it,
and the index is persisted now and then). This module reads no store and no environment: what it
needs is passed in (the engine, drafter and cost in a core.decode.stack.Stack).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..decode.grammar import GrammarError
from ..decode.loop import DecodeStats
from ..decode.speculate import PredictionDrafter
from ..decode.stack import Stack
from .batch import Batcher, Member, batchable
from .choice_stream import stream_choice
from .events import Choice, ChoiceDone, Done, Failed
from .job import Job, LockedTokenizer, now_iso
from .keeper import Keeper, Recorder
from .metrics import Metrics, Stats
from .request_view import fork_drafter, request_stack
from .scopes import Drafting, Scopes, ScopedDrafter, tenant_prefix_caches

log = logging.getLogger("specx.serve")


class Worker:
    """Owns the model; answers up to `max_batch` jobs at once (batched where the engine allows)
    and hands each finished one to `recorder` (None: nothing is kept but the global index in
    memory). `debug`: log tracebacks."""

    def __init__(self, stack: Stack, *, max_queue: int = 16, max_batch: int = 1, metrics: Metrics | None = None,
                 recorder: Recorder | None = None, vocabulary: Any = None,
                 save_cost: Callable[[], None] | None = None, scopes: Scopes | None = None,
                 debug: bool = False) -> None:
        # the engine (its threads tuned), its tokenizer, the global index, the drafter (None: plain
        # decoding), the cost, the prefix cache: shared by the requests
        self.stack = stack
        self.tokenizer = LockedTokenizer(stack.tokenizer)  # the event loop encodes while this thread decodes
        self.keeper = Keeper(recorder, save_cost, debug)  # stores finished requests, persists the index
        self.vocabulary = vocabulary  # core.decode.grammar.Vocabulary: requests with a grammar decode under it
        self.scopes = scopes  # whose history drafts whose request (None: the stack's global index for all)
        self.prefix_caches = tenant_prefix_caches(stack.engine, stack.prefix_cache, scopes)  # None: the stack's
        self.debug = debug
        self._drafting: dict[str, Drafting] = {}  # each scope's acceptance model and guards (_drafting_of)
        self.eos = stack.tokenizer.eos_token_id  # the HTTP side puts it in each request's settings
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.metrics = metrics or Metrics()
        self.metrics.queue_depth.set_function(self.jobs.qsize)
        self.metrics.index_tokens.set_function(lambda: self.index_tokens)
        self.metrics.watch_kv(list(self.prefix_caches.values()) if self.prefix_caches is not None
                              else [stack.prefix_cache] if hasattr(stack.prefix_cache, "evicted_tokens") else [])
        self._stopping = threading.Event()
        self.batched = max_batch > 1 and batchable(stack.engine)
        self.max_batch = max_batch if self.batched else 1
        self.batcher = Batcher(stack.engine, say=lambda m: log.info("batched passes: %s", m)) if self.batched else None
        self._running: dict[Job, Member | None] = {}  # the jobs being decoded
        self._finished: list[tuple[Job, Any]] = []  # batched jobs decoded, to be stored and answered (this thread)
        self.metrics.running.set_function(lambda: len(self._running))
        if self.batcher is not None:
            self.metrics.watch_passes(self.batcher)
        self.died: str | None = None  # why the worker thread ended, when a bug ended it
        self._thread: threading.Thread | None = None

    @property
    def index_tokens(self) -> int:  # in the global indexes requests draft from (every scope's)
        return int(self.scopes.num_tokens if self.scopes is not None else self.stack.global_index.num_tokens)

    def scope_tokens(self, tenant: str) -> int:  # in the index a request of `tenant` drafts from
        return int((self.stack.global_index if self.scopes is None else self.scopes.index(self._scope(tenant))).num_tokens)

    # ------------------------------------------------------------ the HTTP side

    def submit(self, job: Job) -> None:
        """Queue a job; queue.Full when the queue is at its bound, RuntimeError when stopping."""
        if self.died is not None:
            raise RuntimeError(f"the model worker has stopped ({self.died}); restart the server")
        if self._stopping.is_set():
            raise RuntimeError("the server is shutting down")
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the model worker has stopped; restart the server")
        self.jobs.put_nowait(job)
        if self.batcher is not None:
            with self.batcher.cond:  # the worker may be waiting for a pass's parts: it admits the job
                self.batcher.cond.notify_all()

    # ------------------------------------------------------------ the worker thread

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="specx-worker", daemon=True)
        self._thread.start()

    def shutdown_begins(self) -> None:
        """The server is going down (SIGTERM): take no more jobs and end the one being decoded at
        its next step, with an error its client can see (a stream then ends properly)."""
        self._stopping.set()
        for job in list(self._running):
            job.cancelled.set()
        if self.batcher is not None:
            with self.batcher.cond:
                self.batcher.cond.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the running request, turn away the queued ones, persist the index."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread that answers requests is running (False before start and after it ended)."""
        return self.died is None and self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # only a bug gets here (_serve catches what a request raises): say so
            self.died = f"{type(exc).__name__}: {exc}"
            log.critical("the model worker stopped: %s", self.died, exc_info=True)
            self._stopping.set()  # no more jobs are taken (submit: 503); /health says why (Api.health)
            waiting = list(self._running)
            for member in self._running.values():  # a request thread waiting for a pass: it ends
                if member is not None:
                    member.error = RuntimeError(self.died)
                    member.done.set()
            while True:
                try:
                    waiting.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in waiting:  # none of them waits for an answer that cannot come
                job.emit(Failed(503, f"the model worker has stopped ({self.died}); retry once it is restarted"))

    def _serve(self) -> None:
        self.keeper.open()  # on this thread: a store's connection belongs to the thread that opens it
        try:
            (self._serve_batched if self.batched else self._serve_serial)()
        finally:
            self.keeper.close()

    def _serve_serial(self) -> None:  # one job at a time, to its end
        while True:
            try:
                job = self.jobs.get(timeout=0.25)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                self.keeper.due(idle=True)
                if self.scopes is not None:
                    self.scopes.apply()  # rows the store's watcher read, added while nothing decodes
                continue
            if self._stopping.is_set():
                job.emit(Failed(503, "the server is shutting down"))
                continue
            self._running[job] = None
            stack = dataclasses.replace(self.stack, cost=self._drafting_of(job.request.tenant).cost)
            self._finish(job, self._guarded(job, stack))  # (a bug before it: still running, _run answers it)
            self.keeper.due()

    def _serve_batched(self) -> None:
        """Admit jobs up to max_batch, each on a thread of its own (core/serve/batch.py); run a pass
        whenever all of them wait for one; store and answer the finished ones between passes."""
        batcher = self.batcher
        assert batcher is not None

        def wake() -> bool:  # work besides a pass: answers to send, jobs to admit or turn away, the end
            return bool(self._finished) or (len(self._running) < self.max_batch and not self.jobs.empty()) or (
                self._stopping.is_set() and not self._running)

        while True:
            while len(self._running) < self.max_batch:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if self._stopping.is_set():
                    job.emit(Failed(503, "the server is shutting down"))
                    continue
                self._running[job] = member = batcher.join()  # in the next pass
                threading.Thread(target=self._batched_request, args=(job, member), name=f"specx-{job.request.id}",
                                 daemon=True).start()
            members = batcher.ready(wake)
            if members:
                batcher.step(members)
            if self._finished:
                with batcher.baton:
                    finished, self._finished = self._finished, []
                    for job, answer in finished:
                        self._finish(job, answer)
                    self.keeper.due()
            if not self._running:
                if self._stopping.is_set() and self.jobs.empty():
                    return
                with batcher.baton:
                    self.keeper.due(idle=True)
                    if self.scopes is not None:
                        self.scopes.apply()

    def _batched_request(self, job: Job, member: Member) -> None:
        """A batched job's thread: its decoding, its passes through the batcher."""
        batcher = self.batcher
        assert batcher is not None
        with batcher.baton:
            answer = None
            try:
                drafting = self._drafting_of(job.request.tenant)
                stack = dataclasses.replace(self.stack, cost=drafting.cost)
                answer = self._guarded(job, request_stack(stack, batcher, member, drafting.shared_guard))
            finally:
                self._finished.append((job, answer))
                batcher.leave(member)

    def _guarded(self, job: Job, stack: Stack) -> Any:
        """_answer, whatever it raises answered 500 (the next request is answered all the same)."""
        try:
            return self._answer(job, stack)
        except Exception as exc:  # noqa: BLE001
            log.error("%s %s failed: %s: %s", job.request.id, job.request.endpoint, type(exc).__name__,
                      exc, exc_info=self.debug)
            job.emit(Failed(500, f"the request failed: {type(exc).__name__}: {exc}"))
            return None

    def _answer(self, job: Job, stack: Stack) -> Any:
        """Decode a job's choices with `stack`, streaming them; what `_finish` stores and answers
        (None: the job was answered already, with an error or not at all: its client left)."""
        req = job.request
        if job.cancelled.is_set():  # the client left while the request was queued
            self.metrics.cancelled.inc()
            log.info("%s %s cancelled while queued", req.id, req.endpoint)
            return
        started_at = now_iso()
        t0 = time.perf_counter()
        queue_seconds = t0 - job.enqueued
        choices = []
        engine = stack.engine  # it counts the prompt tokens it found cached (Engine.hit_tokens)
        hits = engine.hit_tokens
        cached = 0
        try:
            for i in range(req.n):
                choice = self._decode(job, i, stack)
                if i == 0:  # the prompt as the first choice found it
                    cached = engine.hit_tokens - hits
                if choice is None and self._stopping.is_set():
                    log.info("%s %s stopped after %.2f s: the server is shutting down", req.id, req.endpoint,
                             time.perf_counter() - t0)
                    job.emit(Failed(503, "the server is shutting down: this answer was cut short; retry"))
                    return
                if choice is None:
                    self.metrics.cancelled.inc()
                    log.info("%s %s cancelled after %.2f s: the client went away", req.id, req.endpoint,
                             time.perf_counter() - t0)
                    return
                choices.append(choice)
                job.emit(ChoiceDone(choice))
        except GrammarError as exc:  # a grammar that compiled but fails on the way (a regex too large to build)
            log.info("%s %s refused mid-generation: the grammar of %s failed: %s", req.id, req.endpoint,
                     req.grammar_param, exc)
            job.emit(Failed(400, f"Invalid '{req.grammar_param}': its grammar failed during generation: {exc}",
                            req.grammar_param))
            return
        except Exception as exc:  # a bug or a model failure: answer 500 and keep serving
            log.error("%s %s failed: %s: %s", req.id, req.endpoint, type(exc).__name__, exc,
                      exc_info=self.debug)
            job.emit(Failed(500, f"generation failed: {type(exc).__name__}: {exc}"))
            return
        decoded = DecodeStats()
        for c in choices:
            decoded.add(c.stats)
        predicted = (sum(c.prediction_tokens[0] for c in choices), sum(c.prediction_tokens[1] for c in choices))
        stats = Stats(len(req.prompt_ids), decoded, time.perf_counter() - t0, queue_seconds, cached, predicted)
        self.metrics.observe(stats, req.tenant)
        log.info("%s %s prompt=%d (cached %d) tokens=%d steps=%d accepted=%d (%.2f/step) tokens/s=%.1f seconds=%.2f "
                 "queued=%.2f finish=%s", req.id, req.endpoint, stats.prompt_tokens, stats.cached_tokens,
                 decoded.tokens, decoded.steps, decoded.accepted, decoded.accepted_per_step, stats.tokens_per_s,
                 stats.seconds, stats.queue_seconds, ",".join(c.finish_reason for c in choices))
        return choices, stats, started_at

    def _finish(self, job: Job, answer: Any) -> None:
        """Store a decoded job (on this thread, which owns the store's connection) and answer it. It
        stops counting as running before its answer goes out: a client that reads /metrics after its
        answer does not see itself."""
        if answer is None:
            self._running.pop(job, None)
            return
        choices, stats, started_at = answer
        if self.keeper.record(job.request, choices, stats, started_at):
            self.metrics.stored.inc()  # the answer is durable when it arrives
            if self.scopes is not None:  # learned already (the drafter's finish_request): not added again
                self.scopes.learned(self._scope(job.request.tenant), self.keeper.last_rowids)
        self._running.pop(job, None)
        job.emit(Done(stats))

    def _decode(self, job: Job, index: int, stack: Stack) -> Choice | None:
        """One choice, streamed as deltas (choice_stream.py) with the request's drafter (its scope's
        index; its prediction first) and its tenant's prefix cache; None when the client went away."""
        req = job.request
        drafter = stack.drafter
        if drafter is not None and self.scopes is not None:
            drafter = ScopedDrafter(fork_drafter(drafter), self.scopes, self._scope(req.tenant))
        if drafter is not None and req.prediction_ids:
            drafter = PredictionDrafter(req.prediction_ids, drafter, max_spec_tokens=drafter.max_spec_tokens)
        prefix_cache = stack.prefix_cache if self.prefix_caches is None else self.prefix_caches[req.tenant]
        return stream_choice(job, index, stack, drafter, tokenizer=self.tokenizer, vocabulary=self.vocabulary,
                             acceptance=self._drafting_of(req.tenant).acceptance, prefix_cache=prefix_cache)

    def _scope(self, tenant: str) -> str:  # the scope a tenant's request drafts in and teaches
        return tenant if self.scopes is not None and self.scopes.tenants else ""

    def _drafting_of(self, tenant: str) -> Drafting:  # what its scope's drafts taught (with tenants: its own)
        return Drafting.of(self._drafting, self._scope(tenant), self.stack.cost, self.batched)
