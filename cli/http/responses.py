"""OpenAI API response bodies of `specx serve`: completions, stream chunks, usage, logprobs.

Pure formatting, no HTTP: delivery.py sends what these return. `decode` turns one token id into its
text (the server's tokenizer), for logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..core.decode.loop import TokenLogprob
from ..core.serve.events import Choice
from ..core.serve.metrics import Stats
from ..core.serve.tool_calls import ToolCall, call_marker, parse_tool_calls
from ..core.serve.job import GenerationRequest

Decode = Callable[[int], str]


def usage_json(stats: Stats, speculation: bool = True) -> dict[str, Any]:
    """OpenAI's usage; without `speculation` (the operator hides it) no prediction tokens are told."""
    accepted, rejected = stats.prediction_tokens if speculation else (0, 0)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def completion_json(req: GenerationRequest, created: int, choices: list[Choice], stats: Stats, *,
                    index_tokens: int, decode: Decode, speculation: bool = True) -> dict[str, Any]:
    """The non-streaming body; `specx` (not part of OpenAI's API) holds the speculation figures
    (left out without `speculation`)."""
    def logprobs(c: Choice) -> dict[str, Any] | None:
        return logprobs_json(req, c.token_ids, c.logprobs, decode)

    if req.endpoint == "chat.completions":
        items = []
        for c in choices:
            content, calls = tool_calls(req, c.text, c.finish_reason)
            message = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            items.append({"index": c.index, "message": message, "logprobs": logprobs(c),
                          "finish_reason": finish_reason(c.finish_reason, calls)})
        kind = "chat.completion"
    else:
        items = [{"index": c.index, "text": c.text, "logprobs": logprobs(c), "finish_reason": c.finish_reason}
                 for c in choices]
        kind = "text_completion"
    body = {"id": req.id, "object": kind, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": items, "usage": usage_json(stats, speculation)}
    if speculation:
        body["specx"] = {**stats.to_json(), "global_index_tokens": index_tokens}
    return body


def chunk(req: GenerationRequest, created: int, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
    kind = "chat.completion.chunk" if req.endpoint == "chat.completions" else "text_completion"
    data: dict[str, Any] = {"id": req.id, "object": kind, "created": created, "model": req.model,
                            "system_fingerprint": None, "choices": choices}
    if include_usage:
        data["usage"] = None  # OpenAI: null on every chunk but the last one
    return sse(data)


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def delta(req: GenerationRequest, index: int, text: str | None, finish_reason: str | None, *, role: bool = False,
          logprobs: dict[str, Any] | None = None, calls: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice's part of a stream chunk (`logprobs`: logprobs_json of the tokens it carries;
    `calls`: a HeldText tool_calls delta)."""
    if req.endpoint == "chat.completions":
        body: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            body["content"] = text
        if calls is not None:
            body.update(calls)
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def tool_calls(req: GenerationRequest, text: str, finish: str = "stop") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a chat answer: the text as it is when the request has no tools. An
    answer cut at max_tokens (`finish` "length") keeps its complete calls, not its last broken one."""
    if req.tool_parser is None:
        return text, []
    return parse_tool_calls(req.tool_parser, text, req.tool_names, cut=finish == "length")


def finish_reason(reason: str, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


class HeldText:
    """A streamed chat answer that may turn into tool calls: text is sent until a call may start
    (core.serve.tool_calls.call_marker, or a prefix of it at the end), then held; at the end the whole text
    is parsed, and what was held goes out as tool-call deltas, or as content if it held no call."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req, self.parser = req, req.tool_parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = False
        self.free = self.parser is None  # no call can come any more: send everything

    def push(self, piece: str) -> str:
        """Add a piece of text; returns what can be sent as content now."""
        self.text += piece
        if self.holding:
            return ""
        if self.free:
            cut = len(self.text)
        elif self.parser == "llama3_json":  # a call is the whole answer: it shows in the first characters
            head, tag = self.text.lstrip(), "<|python_tag|>"
            self.holding = head.startswith(("{", tag))
            self.free = bool(head) and not self.holding and not tag.startswith(head)
            cut = len(self.text) if self.free else 0
        else:
            marker = call_marker(self.parser)
            at = self.text.find(marker, self.sent)
            self.holding = at >= 0
            cut = at if self.holding else len(self.text) - _partial(self.text, marker)
        out, self.sent = self.text[self.sent : cut], max(self.sent, cut)
        return out

    def finish(self, reason: str = "stop") -> tuple[str, list[dict[str, Any]], list[ToolCall]]:
        """(content still to send, tool_calls deltas, calls) once the answer is complete (`reason`:
        its finish reason; "length" keeps the complete calls of an answer cut short)."""
        calls = tool_calls(self.req, self.text, reason)[1]
        if not calls:
            return self.text[self.sent :], [], []
        deltas = []
        for k, call in enumerate(calls):  # as OpenAI streams them: id and name first, then the arguments
            deltas.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        return "", deltas, calls


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may become a call)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def logprobs_json(req: GenerationRequest, tokens: list[int], logprobs: list[TokenLogprob] | None,
                  decode: Decode, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's logprobs of these tokens: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
    completions' {tokens, token_logprobs, top_logprobs, text_offset} (offsets from `offset`)."""
    if logprobs is None:
        return None
    texts = [decode(t) for t in tokens]
    if req.endpoint == "chat.completions":
        def entry(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(text, lp.logprob), "top_logprobs": [entry(decode(t), v) for t, v in lp.top]}
                            for text, lp in zip(texts, logprobs)], "refusal": None}
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = [{decode(t): v for t, v in lp.top} for lp in logprobs] if req.settings.logprobs > 0 else None
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets}


