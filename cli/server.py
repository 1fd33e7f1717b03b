"""The OpenAI-compatible HTTP API of `specx serve` (Starlette): validation, SSE streaming, errors.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health   GET /metrics

Requests are validated and tokenized here, then handed to the one model worker (worker.py)
through a bounded queue. Every error is an OpenAI-style body with a 4xx/5xx status:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .worker import Choice, GenerationRequest, Job, LockedTokenizer, Stats, Worker

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_N = 8
MAX_STOP = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


class ApiError(Exception):
    """A request the API refuses, as OpenAI reports it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


# --------------------------------------------------------------------------- request validation

class Tokenizers:
    """How a validated request becomes prompt tokens (the same calls as `specx generate`)."""

    def __init__(self, tokenizer: LockedTokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except Exception as exc:  # jinja errors, a template that rejects a role, ...
            raise ApiError(400, f"the model's chat template cannot render these messages: {exc}", "messages") from None
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    def text(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))


def parse_request(body: Any, endpoint: str, model_names: list[str], context_length: int,
                  tokenizers: Tokenizers) -> tuple[GenerationRequest, bool, bool]:
    """(request, stream, include_usage) from a decoded JSON body, or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise ApiError(400, "you must provide a model parameter", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model", "invalid_type")
    if model not in model_names:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it. "
                            f"This server serves: {', '.join(model_names)}.", "model", "model_not_found")
    _refuse_unsupported(body, endpoint)
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(stream_options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = _bool(stream_options, "include_usage", False, "stream_options.include_usage")
    n = _int(body, "n", 1, 1, MAX_N)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise ApiError(400, "Invalid 'top_p': must be greater than 0", "top_p", "invalid_value")
    top_k = _int(body, "top_k", 0, -1, 1 << 31)  # a vLLM extension; -1 or 0 means all tokens
    seed = _int(body, "seed", None, -(1 << 63), (1 << 63) - 1 - MAX_N)
    stop = _stop(body)
    if endpoint == "chat.completions":
        messages = _messages(body)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ApiError(400, "'tools' must be an array of objects", "tools", "invalid_type")
        prompt_ids = tokenizers.chat(messages, tools)
        prompt_messages, prompt_text, prompt_param = messages, None, "messages"
    else:
        prompt_text, prompt_ids = _prompt(body, tokenizers)
        prompt_messages, prompt_param = None, "prompt"
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", prompt_param)
    room = context_length - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {context_length} tokens. However, your "
                            f"{prompt_param} resulted in {len(prompt_ids)} tokens. Please reduce the length of the "
                            f"{prompt_param}.", prompt_param, "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if endpoint == "chat.completions" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    max_tokens = _int(body, name, default, 1, None)
    if max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {context_length} tokens. However, you requested "
                            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {prompt_param}, "
                            f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} or "
                            f"completion.", name, "context_length_exceeded")
    prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
    request = GenerationRequest(id=f"{prefix}-{uuid.uuid4().hex[:24]}", endpoint=endpoint, model=model,
                                prompt_ids=prompt_ids, max_tokens=max_tokens, prompt_messages=prompt_messages,
                                prompt_text=prompt_text, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                                seed=seed, stop=stop, n=n)
    return request, stream, include_usage


def _refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Parameters whose meaning specx cannot honour get a 400 rather than being silently ignored."""
    def present(name: str) -> bool:  # set to something other than its neutral value
        return body.get(name) not in (None, False, 0)

    if present("logprobs") or present("top_logprobs"):
        raise ApiError(400, "logprobs are not supported by specx serve", "logprobs", "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if present(name):
            raise ApiError(400, f"'{name}' is not supported by specx serve (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by specx serve", "logit_bias", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, "'response_format' other than text is not supported (no constrained decoding)",
                       "response_format", "unsupported_parameter")
    if endpoint == "completions":
        if present("echo"):
            raise ApiError(400, "'echo' is not supported by specx serve", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise ApiError(400, "'suffix' (insertion) is not supported by specx serve", "suffix",
                           "unsupported_parameter")
        best_of = body.get("best_of")
        if best_of not in (None, 1) and best_of != body.get("n", 1):
            raise ApiError(400, "'best_of' is not supported by specx serve", "best_of", "unsupported_parameter")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"Invalid type for '{param}': expected an object", param, "invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"Invalid value for '{param}.role': {role!r}; expected one of {', '.join(CHAT_ROLES)}",
                           f"{param}.role", "invalid_value")
        content = message.get("content")
        if content is None:
            if role not in ("assistant", "function", "tool"):
                raise ApiError(400, f"Missing required parameter: '{param}.content'.", f"{param}.content",
                               "missing_required_parameter")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "refusal") \
                        or not isinstance(part.get(part.get("type")), str):
                    raise ApiError(400, f"'{param}.content[{j}]': only text content parts are supported",
                                   f"{param}.content", "unsupported_content")
                texts.append(part[part["type"]])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ApiError(400, f"Invalid type for '{param}.content': expected a string or an array of text parts",
                           f"{param}.content", "invalid_type")
        out.append({**message, "content": content})
    return out


def _prompt(body: dict[str, Any], tokenizers: Tokenizers) -> tuple[str, list[int]]:
    """The completions prompt: a string, or token ids; a list of one of those is one prompt too."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, tokenizers.text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < tokenizers.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {tokenizers.vocab_size})", "prompt", "invalid_value")
        return tokenizers.tokenizer.decode(prompt), list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request (send several requests, or use n)", "prompt",
                       "unsupported_parameter")
    raise ApiError(400, "'prompt' must be a string or an array of token ids", "prompt", "invalid_type")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP} non-empty strings", "stop", "invalid_value")
    return stops


def _bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{param or name}': expected a boolean", param or name, "invalid_type")
    return value


def _int(body: dict[str, Any], name: str, default: Any, low: int, high: int | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{name}': expected an integer, but got {type(value).__name__}",
                       name, "invalid_type")
    if value < low:
        raise ApiError(400, f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got "
                            f"{value} instead.", name, "integer_below_min_value")
    if high is not None and value > high:
        raise ApiError(400, f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, but got "
                            f"{value} instead.", name, "integer_above_max_value")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ApiError(400, f"Invalid type for '{name}': expected a number", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"Invalid '{name}': expected a number in [{low:g}, {high:g}], but got {value}", name,
                       "invalid_value")
    return float(value)


# --------------------------------------------------------------------------- responses

def usage_json(stats: Stats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens}


def completion_json(req: GenerationRequest, created: int, choices: list[Choice], stats: Stats,
                    index_tokens: int) -> dict[str, Any]:
    """The non-streaming body; `specx` (not part of OpenAI's API) holds the speculation figures."""
    if req.endpoint == "chat.completions":
        items = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                  "logprobs": None, "finish_reason": c.finish_reason} for c in choices]
        kind = "chat.completion"
    else:
        items = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                 for c in choices]
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": items, "usage": usage_json(stats),
            "specx": {**stats.to_json(), "global_index_tokens": index_tokens}}


def _chunk(req: GenerationRequest, created: int, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
    kind = "chat.completion.chunk" if req.endpoint == "chat.completions" else "text_completion"
    data: dict[str, Any] = {"id": req.id, "object": kind, "created": created, "model": req.model,
                            "system_fingerprint": None, "choices": choices}
    if include_usage:
        data["usage"] = None  # OpenAI: null on every chunk but the last one
    return _sse(data)


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def _choice_delta(req: GenerationRequest, index: int, text: str | None, finish_reason: str | None,
                  role: bool = False) -> dict[str, Any]:
    if req.endpoint == "chat.completions":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}


# --------------------------------------------------------------------------- the app

class Api:
    """The routes of one server: a worker, the names it answers to, an optional API key."""

    def __init__(self, worker: Worker, model_names: list[str], context_length: int, api_key: str | None = None) -> None:
        self.worker = worker
        self.metrics = worker.metrics
        self.model_names = model_names
        self.context_length = context_length
        self.api_key = api_key or None
        self.tokenizers = Tokenizers(worker.tokenizer, int(worker.net.config.vocab_size))
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.prometheus, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _server_error},
                         lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Shut the worker down here, not after uvicorn returns: on SIGTERM uvicorn re-raises the
        # signal once it has shut down, which ends the process before any code after it runs.
        self.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.worker.stop)

    # ---- small endpoints

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": self.model_names, "queue_depth": self.worker.jobs.qsize(),
                             "global_index_tokens": int(self.worker.global_index.num_tokens),
                             "speculation": self.worker.drafter is not None})

    async def prometheus(self, request: Request) -> Response:
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

    def _model_json(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specx",
                "max_model_len": self.context_length}

    async def _answer(self, endpoint: str, request: Request, make: Callable[[], Response]) -> Response:
        try:
            self._authorize(request)
            response = make()
        except ApiError as exc:
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
            self._authorize(request)
            body = await _json_body(request)
            # In a thread: rendering and tokenizing a long prompt must not hold up the event loop.
            req, stream, include_usage = await asyncio.to_thread(parse_request, body, endpoint, self.model_names,
                                                                 self.context_length, self.tokenizers)
            job = Job(req, asyncio.get_running_loop())
            try:
                self.worker.submit(job)
            except queue.Full:
                raise ApiError(429, f"The server is busy: {self.worker.jobs.maxsize} requests are already waiting. "
                                    "Retry shortly.", None, "rate_limit_exceeded", "rate_limit_error") from None
            except RuntimeError as exc:
                raise ApiError(503, str(exc), None, "unavailable", "server_error") from None
        except ApiError as exc:
            self.metrics.requests.labels(endpoint, str(exc.status)).inc()
            return exc.response()
        self.metrics.requests.labels(endpoint, "200").inc()
        created = int(time.time())
        if stream:
            return StreamingResponse(self._stream(request, job, created, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(request, job, created)

    async def _collect(self, request: Request, job: Job, created: int) -> Response:
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            choices: list[Choice] = []
            while True:
                event = await job.events.get()
                if event[0] == "choice":
                    choices.append(event[1])
                elif event[0] == "done":
                    return JSONResponse(completion_json(job.request, created, choices, event[1],
                                                        int(self.worker.global_index.num_tokens)))
                elif event[0] == "error":
                    return ApiError(event[1], event[2], None, None, "server_error").response()
                elif event[0] == "cancelled":
                    return Response(status_code=499)  # nobody reads it: the client has gone
        finally:
            watcher.cancel()
            job.cancelled.set()  # no effect once the worker is done with it

    async def _stream(self, request: Request, job: Job, created: int, include_usage: bool) -> AsyncIterator[bytes]:
        req = job.request
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            if req.endpoint == "chat.completions":  # OpenAI's first chunk names the role
                yield _chunk(req, created, [_choice_delta(req, i, None, None, role=True) for i in range(req.n)],
                             include_usage)
            while True:
                event = await job.events.get()
                if event[0] == "delta":
                    yield _chunk(req, created, [_choice_delta(req, event[1], event[2], None)], include_usage)
                elif event[0] == "choice":
                    choice: Choice = event[1]
                    yield _chunk(req, created, [_choice_delta(req, choice.index, None, choice.finish_reason)],
                                 include_usage)
                elif event[0] == "done":
                    if include_usage:
                        kind = "chat.completion.chunk" if req.endpoint == "chat.completions" else "text_completion"
                        yield _sse({"id": req.id, "object": kind, "created": created, "model": req.model,
                                    "system_fingerprint": None, "choices": [], "usage": usage_json(event[1]),
                                    "specx": {**event[1].to_json(),
                                              "global_index_tokens": int(self.worker.global_index.num_tokens)}})
                    yield b"data: [DONE]\n\n"
                    return
                elif event[0] == "error":
                    yield _sse({"error": {"message": event[2], "type": "server_error", "param": None, "code": None}})
                    return
                elif event[0] == "cancelled":
                    return
        finally:
            watcher.cancel()
            job.cancelled.set()  # the client closed the stream early: the worker stops at its next step

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided." if header else
                           "You didn't provide an API key (Authorization: Bearer KEY).", None, "invalid_api_key")


async def _json_body(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", None, "request_too_large")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "We could not parse the JSON body of your request. The OpenAI API expects a JSON "
                            "payload (Content-Type: application/json).", None, "invalid_json") from None


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (the body has been read: only a disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            job.events.put_nowait(("cancelled",))
            return


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    message = {404: f"Unknown request URL: {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed for {request.url.path}."}.get(status, str(exc))
    return ApiError(status, message, None, {404: "unknown_url", 405: "method_not_allowed"}.get(status)).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    import logging

    logging.getLogger("specx.serve").error("%s %s failed: %s: %s", request.method, request.url.path,
                                           type(exc).__name__, exc)
    return ApiError(500, "The server had an error while processing your request.", None, None,
                    "server_error").response()
