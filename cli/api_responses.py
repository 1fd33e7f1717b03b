"""OpenAI API response bodies of `specx serve`: completions, stream chunks, usage, logprobs.

Pure formatting, no HTTP: server.py sends what these return. `decode` turns one token id into its
text (the server's tokenizer), for logprobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from specx.core.decode import TokenLogprob
from specx.core.serving import Choice, GenerationRequest, Stats

Decode = Callable[[int], str]


def usage_json(stats: Stats) -> dict[str, Any]:
    accepted, rejected = stats.prediction_tokens
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def completion_json(req: GenerationRequest, created: int, choices: list[Choice], stats: Stats,
                    index_tokens: int, decode: Decode) -> dict[str, Any]:
    """The non-streaming body; `specx` (not part of OpenAI's API) holds the speculation figures."""
    def logprobs(c: Choice) -> dict[str, Any] | None:
        return logprobs_json(req, c.token_ids, c.logprobs, decode)

    if req.endpoint == "chat.completions":
        items = [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                  "logprobs": logprobs(c), "finish_reason": c.finish_reason} for c in choices]
        kind = "chat.completion"
    else:
        items = [{"index": c.index, "text": c.text, "logprobs": logprobs(c), "finish_reason": c.finish_reason}
                 for c in choices]
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": items, "usage": usage_json(stats),
            "specx": {**stats.to_json(), "global_index_tokens": index_tokens}}


def chunk(req: GenerationRequest, created: int, choices: list[dict[str, Any]], include_usage: bool) -> bytes:
    kind = "chat.completion.chunk" if req.endpoint == "chat.completions" else "text_completion"
    data: dict[str, Any] = {"id": req.id, "object": kind, "created": created, "model": req.model,
                            "system_fingerprint": None, "choices": choices}
    if include_usage:
        data["usage"] = None  # OpenAI: null on every chunk but the last one
    return sse(data)


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def delta(req: GenerationRequest, index: int, text: str | None, finish_reason: str | None, role: bool = False,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice's part of a stream chunk (`logprobs`: logprobs_json of the tokens it carries)."""
    if req.endpoint == "chat.completions":
        body: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            body["content"] = text
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


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
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode(t): v for t, v in lp.top} for lp in logprobs] if req.logprobs > 0 else None,
            "text_offset": offsets}


