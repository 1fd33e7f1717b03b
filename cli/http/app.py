"""The OpenAI-compatible HTTP API of `specx serve` (Starlette): routes, the request body, errors.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics
    POST /tokenize   POST /detokenize   (vLLM's: a prompt or chat messages to token ids, and back)

Requests are validated and tokenized (requests.py, tokens.py), then handed to the one model worker
(core/serve/worker.py) through a bounded queue; its events become the answer, one JSON body or an
SSE stream, in delivery.py. Every error is an OpenAI-style body with a 4xx/5xx status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.serve.job import Job
from ..core.serve.pace import Pace
from ..core.serve.worker import Worker
from .auth import Keys
from .delivery import Delivery
from .errors import ApiError
from .requests import parse_detokenize, parse_request, parse_tokenize
from .tokens import Tokenizers

MAX_BODY_BYTES = 32 * 1024 * 1024
PARSE_ON_LOOP_BYTES = 1 << 20  # a body larger than this is parsed in a thread
log = logging.getLogger("specx.serve")


# --------------------------------------------------------------------------- the app

class Api:
    """The routes of one server: a worker, the names it answers to, an optional API key."""

    def __init__(self, metrics: Any, model_names: list[str], api_key: str | None = None,
                 allowed_origins: list[str] | None = None, tool_parser: str | None = None, *,
                 tenants: dict[str, str] | None = None, pace: Callable[[Any], Pace] | None = None,
                 show_speculation: bool = True) -> None:
        self.keys = Keys(api_key, tenants)  # who may call (and as which tenant): auth.py
        self.metrics = metrics
        self.model_names = model_names
        self.allowed_origins = allowed_origins or []  # CORS: browsers on these origins may call the API
        self.tool_parser = tool_parser  # core.serve.tools' format of tool calls (None: from the chat template)
        self.pace = pace  # a request's clock (core/serve/pace.py, cli/live.py; None: the stream is not shaped)
        self.show_speculation = show_speculation  # the body's `specx` figures and accepted prediction tokens
        self.corpora: Any = None  # corpus.py's routes, when the server has a store
        self.created = int(time.time())
        self.stage = "starting"  # what loading is doing (GET /health says it until ready)
        self.worker: Worker | None = None  # set by ready(): until then every API call gets 503
        self.context_length = 0
        self.tokenizers: Tokenizers | None = None

    @property
    def tenants(self) -> list[str]:
        return self.keys.tenants

    def ready(self, worker: Worker, context_length: int, announce: Callable[[], None] = lambda: None) -> None:
        """The model is loaded: start answering (the port was open, saying 503 loading, until now).
        `announce` (the log's "ready" lines) runs before /health says ok, so a log never lags it."""
        self.context_length = context_length
        self.tokenizers = Tokenizers(worker.tokenizer, worker.stack.engine.vocab_size, worker.vocabulary,
                                    self.tool_parser, worker.eos)
        worker.start()
        announce()
        self.worker = worker

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        if self.corpora is not None:
            routes += [Route("/v1/corpus", self.corpora.add, methods=["POST"]),
                       Route("/v1/corpus", self.corpora.list, methods=["GET"]),
                       Route("/v1/corpus/{name}", self.corpora.remove, methods=["DELETE"])]
        middleware = [Middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=["*"],
                                 allow_headers=["*"])] if self.allowed_origins else []
        return Starlette(routes=routes, middleware=middleware, lifespan=self.lifespan,
                         exception_handlers={HTTPException: _http_error, Exception: _server_error})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Shut the worker down here, not after uvicorn returns: on SIGTERM uvicorn re-raises the
        # signal once it has shut down, which ends the process before any code after it runs.
        try:
            yield
        finally:
            if self.worker is not None:
                await asyncio.to_thread(self.worker.stop)

    # ---- small endpoints

    async def health(self, request: Request) -> Response:
        if self.worker is None:
            return JSONResponse({"status": "loading", "stage": self.stage, "models": self.model_names},
                                status_code=503, headers={"Retry-After": "1"})
        if not self.worker.alive:  # a bug ended the thread that answers: nothing will be answered (restart)
            return JSONResponse({"status": "unhealthy", "reason": "the model worker has stopped: "
                                 f"{self.worker.died or 'unknown cause'}", "models": self.model_names},
                                status_code=503)
        body = {"status": "ok", "models": self.model_names, "queue_depth": self.worker.jobs.qsize(),
                "global_index_tokens": self.worker.index_tokens, "speculation": self.worker.stack.drafter is not None}
        if self.tenants:  # open to all: the status alone; the queue's depth (others' load) and the histories' size to the operator
            try:
                self.keys.operator(request.headers.get("authorization", ""))
            except ApiError:
                return JSONResponse({"status": "ok", "models": self.model_names})
            del body["global_index_tokens"]
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        try:  # with --api-key, the metrics (request counts, timings) are the API's too; with tenants the operator's
            self.keys.operator(request.headers.get("authorization", ""))
        except ApiError as exc:
            return exc.response()
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return await self._answer("models", request, lambda: JSONResponse(
            {"object": "list", "data": [self._model_json(name) for name in self.model_names]}))

    async def model(self, request: Request) -> Response:
        def one() -> Response:
            name = request.path_params["model"]
            if name not in self.model_names:
                raise ApiError(404, f"The model `{name}` does not exist or you do not have access to it.", "model",
                               "model_not_found")
            return JSONResponse(self._model_json(name))
        return await self._answer("models", request, one)

    async def tokenize(self, request: Request) -> Response:
        """{"count", "tokens", "max_model_len"}: what the completions endpoints would feed the model."""
        async def make() -> Response:
            ids = await asyncio.to_thread(parse_tokenize, await _json_body(request), self.model_names, self.tokenizers,
                                          self.context_length)
            return JSONResponse({"count": len(ids), "tokens": ids, "max_model_len": self.context_length})
        return await self.answer_async("tokenize", request, make)

    async def detokenize(self, request: Request) -> Response:
        """{"prompt": text} of the token ids."""
        async def make() -> Response:
            ids = parse_detokenize(await _json_body(request), self.model_names, self.tokenizers.vocab_size,
                                   self.context_length)
            return JSONResponse({"prompt": await asyncio.to_thread(self.worker.tokenizer.decode, ids)})
        return await self.answer_async("detokenize", request, make)

    def _model_json(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specx",
                "max_model_len": self.context_length}

    async def _answer(self, endpoint: str, request: Request, make: Callable[[], Response]) -> Response:
        async def run() -> Response:
            return make()
        return await self.answer_async(endpoint, request, run)

    async def answer_async(self, endpoint: str, request: Request, make: Callable[[], Any]) -> Response:
        """`make()`'s response, or the ApiError it (or authorizing, or loading) raised, counted."""
        try:
            self.tenant_of(request)
            self._check_ready()
            response = await make()
        except ApiError as exc:
            _log_refused(endpoint, exc)
            response = exc.response()
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    # ---- completions

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat.completions")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completions")

    async def _complete(self, request: Request, endpoint: str) -> Response:
        try:
            tenant = self.tenant_of(request)
            self._check_ready()
            body = await _json_body(request)
            # In a thread: rendering and tokenizing a long prompt must not hold up the event loop.
            req, stream, include_usage = await asyncio.to_thread(parse_request, body, endpoint, self.model_names,
                                                                 self.context_length, self.tokenizers)
            req.tenant = tenant
            job = Job(req, asyncio.get_running_loop())
            job.pace = self.pace(req) if self.pace is not None else None  # shaped: its clock, kept by the worker too
            try:
                self.worker.submit(job)
            except queue.Full:
                raise ApiError(429, f"The server is busy: {self.worker.jobs.maxsize} requests are already waiting. "
                                    "Retry shortly.", None, "rate_limit_exceeded", "rate_limit_error") from None
            except RuntimeError as exc:
                raise ApiError(503, str(exc), None, "unavailable", "server_error") from None
        except ApiError as exc:
            _log_refused(endpoint, exc)
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return exc.response()
        created = int(time.time())
        delivery = Delivery(self.tokenizers.tokenizer.decode, self.worker.scope_tokens, self.show_speculation)
        if stream:
            self.metrics.requests.labels(endpoint, "200").inc()  # sent at once; a later error goes in the stream
            return StreamingResponse(delivery.stream(request, job, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response = await delivery.collect(request, job, created)
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    def _check_ready(self) -> None:
        if self.worker is None:
            raise ApiError(503, f"The model is loading ({self.stage}); retry shortly.", None, "model_loading",
                           "server_error")

    def tenant_of(self, request: Request) -> str:
        """The caller's tenant ('' without tenants); ApiError 401 for a key that names none."""
        return self.keys.tenant(request.headers.get("authorization", ""))

    async def json_body(self, request: Request) -> Any:
        return await _json_body(request)


async def _json_body(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
    raw = b""
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None,
                               "request_too_large")
    except ClientDisconnect:  # e.g. a Content-Length larger than the body, then the client closed: one log line
        of = f" of the {declared} its Content-Length declared" if declared is not None else ""
        raise ApiError(400, f"the client went away after sending {len(raw):,} bytes of the request body{of}", None,
                       "incomplete_body") from None
    try:  # a large body is parsed off the event loop: /health and the other requests go on meanwhile
        return json.loads(raw) if len(raw) < PARSE_ON_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "We could not parse the JSON body of your request. The OpenAI API expects a JSON "
                            "payload (Content-Type: application/json).", None, "invalid_json") from None


def _log_refused(endpoint: str, exc: ApiError) -> None:
    """A refused request is one log line: status, code, parameter, message (the operator's view of a 4xx)."""
    log.info("refused %s: %d %s%s: %s", endpoint, exc.status, exc.code or exc.kind,
             f" (param {exc.param})" if exc.param else "", exc.message)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    message = {404: f"Unknown request URL: {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed for {request.url.path}."}.get(status, str(exc))
    return ApiError(status, message, None, {404: "unknown_url", 405: "method_not_allowed"}.get(status)).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s: %s", request.method, request.url.path,
                                           type(exc).__name__, exc)
    return ApiError(500, "The server had an error while processing your request.", None, None,
                    "server_error").response()
