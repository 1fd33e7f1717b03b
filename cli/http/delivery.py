"""A submitted completion's answer on the wire: the worker's events (core/serve/events.py) as one
JSON body (`Delivery.collect`) or as a stream of server-sent events (`Delivery.stream`: OpenAI's
chunks, the usage chunk when asked for, `data: [DONE]`; an error after the first byte is an error
event, the stream still ending as a stream does).

With a pace (core/serve/pace.py) the answer is shaped (shaping.py): a stream sends one token per
event, each in its slot of the clock, padded; a JSON body is held until that clock would have sent
its last token. Text that may be a tool call is held until its end (responses.HeldText). While
the answer is under way the client's disconnect is watched (`watch_disconnect`): the job is
cancelled, and the worker stops at its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..core.serve.events import Cancelled, Choice, ChoiceDone, Delta, Done, Failed
from ..core.serve.job import Job
from .errors import ApiError
from .responses import HeldText, chunk, completion_json, delta, finish_reason, logprobs_json, sse, usage_json
from .shaping import Pacer, pad, split_tokens


class Delivery:
    """How one server answers: `decode` (token ids to text: the server's tokenizer), `scope_tokens`
    (tenant -> the tokens of the index its requests draft from, told in the `specx` figures) and
    `speculation` (whether the `specx` figures and accepted prediction tokens are shown)."""

    def __init__(self, decode: Callable[[list[int]], str], scope_tokens: Callable[[str], int],
                 speculation: bool = True) -> None:
        self.decode, self.scope_tokens, self.speculation = decode, scope_tokens, speculation

    def _token_text(self, token: int) -> str:
        return self.decode([token])

    async def collect(self, request: Request, job: Job, created: int) -> Response:
        """The answer as one JSON body (a refusal as its error body; 499 when the client left)."""
        watcher = asyncio.create_task(watch_disconnect(request, job))
        loop, first = asyncio.get_running_loop(), None  # when the first token was ready (shaping's clock)
        try:
            choices: list[Choice] = []
            while True:
                match await job.events.get():
                    case Delta():
                        first = loop.time() if first is None else first
                    case ChoiceDone(choice):
                        choices.append(choice)
                    case Done(stats):
                        if job.pace is not None and first is not None:  # held as a shaped stream would end
                            await asyncio.sleep(max(0.0, Pacer.of(job.pace).hold_until(
                                first, stats.completion_tokens) - loop.time()))
                        return JSONResponse(completion_json(job.request, created, choices, stats,
                                                            index_tokens=self.scope_tokens(job.request.tenant),
                                                            decode=self._token_text,
                                                            speculation=self.speculation))
                    case Failed() as failed:
                        return ApiError.from_failure(failed).response()
                    case Cancelled():
                        return Response(status_code=499)  # nobody reads it: the client has gone
        finally:
            watcher.cancel()
            job.cancelled.set()  # no effect once the worker is done with it

    async def stream(self, request: Request, job: Job, created: int, include_usage: bool) -> AsyncIterator[bytes]:
        """The answer as server-sent events, to its `data: [DONE]` (none when the client left)."""
        req = job.request
        offsets = [0] * req.n  # completions' logprobs: text_offset of each choice's next token
        held = [HeldText(req) for _ in range(req.n)]  # text that may be a tool call waits for its end
        unsent: list[list[Any]] = [[[], []] for _ in range(req.n)]  # tokens and logprobs not sent yet

        def piece(index: int, text: str | None, **kwargs: Any) -> bytes:
            tokens, logprobs = unsent[index]
            lp = logprobs_json(req, tokens, logprobs, self._token_text, offsets[index]) if tokens else None
            unsent[index] = [[], []]
            offsets[index] += len(text or "")
            return chunk(req, created, [delta(req, index, text, None, logprobs=lp, **kwargs)], include_usage)

        pacer = Pacer.of(job.pace) if job.pace is not None else None  # shaping.py: one token per event

        def wire(event: bytes) -> bytes:  # shaped: padded, its size says nothing of its text
            return event if pacer is None else pad(event)
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            if req.endpoint == "chat.completions":  # OpenAI's first chunk names the role
                yield wire(chunk(req, created, [delta(req, i, None, None, role=True) for i in range(req.n)],
                                 include_usage))
            while True:
                match await job.events.get():
                    case Delta(index, text, tokens, logprobs):
                        parts = [text] if pacer is None else split_tokens(text, tokens, self.decode)
                        for i, part in enumerate(parts):
                            if logprobs is not None:
                                one = slice(None) if pacer is None else slice(i, i + 1)
                                unsent[index][0] += tokens[one]
                                unsent[index][1] += logprobs[one]
                            part = held[index].push(part)
                            if pacer is not None:  # every token its slot, sent or held (a tool call's,
                                await pacer.wait()  # a stop string's, a character's first bytes)
                            if part:
                                yield wire(piece(index, part))
                    case ChoiceDone(choice):
                        rest, call_deltas, calls = held[choice.index].finish(choice.finish_reason)
                        if pacer is not None:
                            await pacer.wait()
                        if rest or unsent[choice.index][0] and not call_deltas:
                            yield wire(piece(choice.index, rest))
                        for calls_delta in call_deltas:
                            yield wire(piece(choice.index, None, calls=calls_delta))
                        yield wire(chunk(req, created, [delta(req, choice.index, None, finish_reason(
                            choice.finish_reason, calls))], include_usage))
                    case Done(stats):
                        if include_usage:
                            kind = "chat.completion.chunk" if req.endpoint == "chat.completions" else "text_completion"
                            body = {"id": req.id, "object": kind, "created": created, "model": req.model,
                                    "system_fingerprint": None, "choices": [],
                                    "usage": usage_json(stats, self.speculation)}
                            if self.speculation:
                                body["specx"] = {**stats.to_json(),
                                                 "global_index_tokens": self.scope_tokens(req.tenant)}
                            yield wire(sse(body))
                        yield b"data: [DONE]\n\n"
                        return
                    case Failed() as failed:  # the stream still ends as a stream does
                        error = ApiError.from_failure(failed)
                        yield sse({"error": {"message": error.message, "type": error.kind, "param": error.param,
                                             "code": error.code}})
                        yield b"data: [DONE]\n\n"
                        return
                    case Cancelled():
                        return
        finally:
            watcher.cancel()
            job.cancelled.set()  # the client closed the stream early: the worker stops at its next step


async def watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client disconnects (the body has been read: only a disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            job.events.put_nowait(Cancelled())
            return
