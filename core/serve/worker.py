"""The thread that owns the model for `specx serve`: one request at a time, from a bounded queue.

The HTTP side (cli/http/app.py) validates a request, wraps it in a Job and submits it; a full
queue raises queue.Full (HTTP 429). The worker decodes it with the same loop as `specx generate`
(core.decode.generate with a SuffixDrafter over the global index) and sends typed events back to
the event loop through `loop.call_soon_threadsafe` into the job's asyncio.Queue (events.py: a
Delta of new text per step, a ChoiceDone per choice, then Done with the request's Stats; or Failed
with an HTTP status, a message and the request's parameter at fault).

A client that goes away sets `job.cancelled`; the worker checks it between verification steps
and closes the decode loop, which ends the request without learning from it. A finished request
has already entered the global index (the drafter's finish_request); the worker then hands it to
its Recorder (the "request finished" hook: `specx serve` passes store.served.ServedRecorder,
which stores it in one transaction) and now and then asks it to persist the index, so a
restarted server drafts from everything it served. This module reads no store and no
environment: what it needs is passed in (the engine, drafter and cost in a core.decode.stack.Stack).
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from ..cost.acceptance import AcceptanceModel
from ..decode.generate import generate
from ..decode.grammar import GrammarError
from ..decode.loop import DecodeStats, Decoded, collect
from ..decode.speculate import PredictionDrafter
from ..decode.stack import Stack
from ..decode.text import TextStream
from .events import Choice, ChoiceDone, Delta, Done, Event, Failed
from .metrics import Metrics, Stats

log = logging.getLogger("specx.serve")

PERSIST_EVERY = 16  # requests between index saves while busy (a save costs ~0.1 s per 350k tokens)
PERSIST_IDLE_S = 10.0  # save after this long with unsaved requests and nothing queued


@dataclass
class GenerationRequest:
    """A validated request: what to decode and how."""

    id: str
    endpoint: str  # "chat.completions" or "completions"
    model: str  # the name the client asked for
    prompt_ids: list[int]
    max_tokens: int
    prompt_messages: list[dict[str, Any]] | None = None  # chat
    prompt_text: str | None = None  # completions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    prediction_ids: list[int] | None = None  # OpenAI's Predicted Outputs: the first draft source
    grammar: str | None = None  # an llguidance grammar every output token follows (response_format, tool_choice)
    grammar_param: str | None = None  # the request's param it came from (named when it fails)
    logprobs: int = -1  # >= 0: report each token's log-probability and that many top alternatives
    tool_parser: str | None = None  # the output may hold tool calls in this core.serve.tools format
    tool_names: list[str] | None = None  # of the request's functions


class Job:
    """A request on its way through the worker, and the channel its events come back on."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued = time.perf_counter()

    def emit(self, event: Event) -> None:
        """Send an event to the event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class LockedTokenizer:
    """The tokenizer behind one lock: the event loop encodes prompts while the worker decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def decode(self, *args: Any, **kwargs: Any) -> str:
        with self.lock:
            return self.tokenizer.decode(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        with self.lock:
            return self.tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.tokenizer.apply_chat_template(*args, **kwargs)


class Recorder(Protocol):
    """Where finished requests go, called on the worker's thread only: `open` when the thread
    starts, `record` after each answered request (True when it was stored), `persist` to save the
    global index (every PERSIST_EVERY records and when idle; False: it failed, try again later),
    `close` when the thread ends. A failure is the recorder's to log: the worker keeps serving (and
    logs what a recorder raises all the same: the answer still goes out)."""

    def open(self) -> None: ...

    def record(self, request: GenerationRequest, choices: list[Choice], stats: Stats, started_at: str,
               ended_at: str) -> bool: ...

    def persist(self) -> bool: ...

    def close(self) -> None: ...


class Worker:
    """Owns the model; answers jobs one at a time and hands each finished one to `recorder`
    (None: nothing is kept but the global index in memory). `debug`: log tracebacks."""

    def __init__(self, stack: Stack, *, max_queue: int = 16, metrics: Metrics | None = None,
                 recorder: Recorder | None = None, vocabulary: Any = None,
                 save_cost: Callable[[], None] | None = None, debug: bool = False) -> None:
        # the engine, its tokenizer, the global index, the drafter (None: plain decoding), the cost,
        # the thread tuner, the prefix cache: shared by the requests
        self.stack = stack
        self.tokenizer = LockedTokenizer(stack.tokenizer)  # the event loop encodes while this thread decodes
        self.save_cost = save_cost  # keeps what the learned cost has learned, with the index
        self.vocabulary = vocabulary  # core.decode.grammar.Vocabulary: requests with a grammar decode under it
        self.recorder = recorder
        self.debug = debug
        self.acceptance = AcceptanceModel()  # what the drafts are worth, learned from verdicts across requests
        self.eos = stack.tokenizer.eos_token_id
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.metrics = metrics or Metrics()
        self.metrics.queue_depth.set_function(self.jobs.qsize)
        self.metrics.index_tokens.set_function(lambda: self.stack.global_index.num_tokens)
        self._stopping = threading.Event()
        self._current: Job | None = None  # the job being decoded
        self.died: str | None = None  # why the worker thread ended, when a bug ended it
        self._thread: threading.Thread | None = None
        self._unsaved = 0  # requests stored since the index was last persisted
        self._saved_at = time.monotonic()

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
        job = self._current
        if job is not None:
            job.cancelled.set()

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
            waiting = [self._current] if self._current is not None else []
            while True:
                try:
                    waiting.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            for job in waiting:  # none of them waits for an answer that cannot come
                job.emit(Failed(503, f"the model worker has stopped ({self.died}); retry once it is restarted"))

    def _serve(self) -> None:
        if self.recorder is not None:
            try:
                self.recorder.open()  # on this thread: a store's connection belongs to the thread that opens it
            except Exception as exc:  # noqa: BLE001 - answering matters more than storing
                log.error("cannot store answered requests: %s: %s", type(exc).__name__, exc, exc_info=self.debug)
                self.recorder = None
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=0.25)
                except queue.Empty:
                    if self._stopping.is_set():
                        break
                    if self._unsaved and time.monotonic() - self._saved_at >= PERSIST_IDLE_S:
                        self._persist()
                    continue
                if self._stopping.is_set():
                    job.emit(Failed(503, "the server is shutting down"))
                    continue
                self._current = job
                try:
                    self._answer(job)
                except Exception as exc:  # noqa: BLE001 - whatever one request raises, the next is answered
                    log.error("%s %s failed: %s: %s", job.request.id, job.request.endpoint, type(exc).__name__,
                              exc, exc_info=self.debug)
                    job.emit(Failed(500, f"the request failed: {type(exc).__name__}: {exc}"))
                self._current = None  # (still set when a bug ends the thread: _run answers it)
                if self._unsaved >= PERSIST_EVERY:
                    self._persist()
        finally:
            if self._unsaved:
                self._persist()
            if self.recorder is not None:
                try:
                    self.recorder.close()
                except Exception as exc:  # noqa: BLE001
                    log.error("cannot close the store of answered requests: %s: %s", type(exc).__name__, exc)

    def _answer(self, job: Job) -> None:
        req = job.request
        if job.cancelled.is_set():  # the client left while the request was queued
            self.metrics.cancelled.inc()
            log.info("%s %s cancelled while queued", req.id, req.endpoint)
            return
        started_at = _now()
        t0 = time.perf_counter()
        queue_seconds = t0 - job.enqueued
        choices = []
        engine = self.stack.engine  # it counts the prompt tokens it found cached (Engine.hit_tokens)
        hits = engine.hit_tokens
        cached = 0
        try:
            for i in range(req.n):
                choice = self._decode(job, i)
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
        self.metrics.observe(stats)
        log.info("%s %s prompt=%d (cached %d) tokens=%d steps=%d accepted=%d (%.2f/step) tokens/s=%.1f seconds=%.2f "
                 "queued=%.2f finish=%s", req.id, req.endpoint, stats.prompt_tokens, stats.cached_tokens,
                 decoded.tokens, decoded.steps, decoded.accepted, decoded.accepted_per_step, stats.tokens_per_s,
                 stats.seconds, stats.queue_seconds, ",".join(c.finish_reason for c in choices))
        if self.recorder is not None and self._record(req, choices, stats, started_at):  # ~1 ms
            self.metrics.stored.inc()  # the answer is durable when it arrives
            self._unsaved += 1
        job.emit(Done(stats))

    def _record(self, req: GenerationRequest, choices: list[Choice], stats: Stats, started_at: str) -> bool:
        """Hand a finished request to the recorder; what it raises is logged, and the answer still goes out."""
        try:
            return bool(self.recorder.record(req, choices, stats, started_at, _now()))
        except Exception as exc:  # noqa: BLE001 - a recorder's failure must not cost the answer or the worker
            log.error("%s: could not store the request: %s: %s", req.id, type(exc).__name__, exc,
                      exc_info=self.debug)
            return False

    def _decode(self, job: Job, index: int) -> Choice | None:
        """One choice, streamed as deltas; None when the client went away."""
        req = job.request
        text = TextStream(self.tokenizer, stop=req.stop)
        stack = self.stack
        drafter = stack.drafter
        if drafter is not None and req.prediction_ids:
            drafter = PredictionDrafter(req.prediction_ids, drafter, max_spec_tokens=drafter.max_spec_tokens)
        steps = generate(stack.engine, req.prompt_ids, drafter, max_new_tokens=req.max_tokens,
                         eos_token_ids=self.eos, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         seed=None if req.seed is None else req.seed + index,
                         cost=stack.cost if stack.drafter is not None else None, stop=text,
                         acceptance=self.acceptance, prefix_cache=stack.prefix_cache,
                         constraint=self.vocabulary.constraint(req.grammar, [self.eos]) if req.grammar else None,
                         logprobs=req.logprobs, threads=stack.threads,
                         successors=stack.successors if stack.drafter is not None else None)
        sent = 0  # tokens whose text went out in a delta

        def stream(step: Any, run: Decoded) -> bool:
            nonlocal sent
            if job.cancelled.is_set():
                return False  # the decode is closed without learning
            piece = text.pop()
            if piece:
                job.emit(Delta(index, piece, run.tokens[sent:], None if run.logprobs is None else run.logprobs[sent:]))
                sent = len(run.tokens)
            return True

        run = collect(steps, stream, logprobs=req.logprobs >= 0)
        if run is None:
            return None
        tokens, logprobs = run.tokens, run.logprobs
        piece = text.pop(final=True)
        if piece or (logprobs and sent < len(tokens)):
            job.emit(Delta(index, piece, tokens[sent:], None if logprobs is None else logprobs[sent:]))
        return Choice(index, text.text, tokens, text.finish_reason(req.max_tokens, self.eos), run.stats,
                      prediction_tokens(req.prediction_ids, tokens), logprobs)

    def _persist(self) -> None:
        self._saved_at = time.monotonic()
        try:
            if self.save_cost is not None:
                self.save_cost()
            if self.recorder is None or self.recorder.persist():
                self._unsaved = 0
        except Exception as exc:  # noqa: BLE001 - tried again later; the worker goes on
            log.error("could not persist the index: %s: %s", type(exc).__name__, exc, exc_info=self.debug)


def prediction_tokens(prediction: list[int] | None, output: list[int]) -> tuple[int, int]:
    """(tokens of the prediction that appear in the output, those that do not), as OpenAI counts
    accepted and rejected prediction tokens: the matching blocks of the two token sequences.

    >>> prediction_tokens([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6])
    (4, 1)
    """
    if not prediction:
        return 0, 0
    blocks = difflib.SequenceMatcher(None, prediction, output, autojunk=False).get_matching_blocks()
    accepted = sum(b.size for b in blocks)
    return accepted, len(prediction) - accepted


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
