"""One streamed chat completion against any OpenAI-compatible server, timed: what `specx bench
tasks` sends for each turn. Standard library HTTP only (no client package), so that it speaks to
specx, llama-server and vLLM alike.

Besides the text, the answer keeps what the server says about its work, wherever it says it:
OpenAI's `usage` (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens: specx,
vLLM with --enable-prompt-tokens-details, newer llama-server), llama-server's `timings`
(prompt_n computed, cache_n reused, predicted_n, and with speculation draft_n and
draft_n_accepted), and specx's own `specx` object (steps: its verification passes).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any


class ServerError(ValueError):
    """A server that cannot be used: a malformed URL, or one that does not answer; one line."""


@dataclass
class Answer:
    """One turn's answer as the server streamed it; counts are None where the server did not say."""

    text: str = ""
    seconds: float = 0.0  # from sending the request to the end of the stream
    ttft_s: float | None = None  # from sending the request to the first chunk with text
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens whose KV the server reused (not computed)
    steps: int | None = None  # forward passes that produced the answer (specx's, or llama-server's drafts)
    finish_reason: str | None = None
    error: str | None = None

    def read_usage(self, usage: dict[str, Any] | None, timings: dict[str, Any] | None,
                   specx: dict[str, Any] | None) -> None:
        """Fill the counts from the stream's last `usage`, llama-server's `timings` and specx's figures.

        >>> a = Answer()
        >>> a.read_usage(None, {"prompt_n": 40, "cache_n": 960, "predicted_n": 12, "draft_n": 9,
        ...                     "draft_n_accepted": 6}, None)
        >>> a.prompt_tokens, a.cached_tokens, a.completion_tokens, a.steps
        (1000, 960, 12, 6)
        """
        usage, timings = usage or {}, timings or {}
        details = usage.get("prompt_tokens_details") or {}
        self.prompt_tokens = _int(usage.get("prompt_tokens"))
        self.completion_tokens = _int(usage.get("completion_tokens"))
        self.cached_tokens = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
        prompt_n, cache_n, predicted_n = (_int(timings.get(k)) for k in ("prompt_n", "cache_n", "predicted_n"))
        if self.cached_tokens is None:
            self.cached_tokens = cache_n
        if self.prompt_tokens is None and prompt_n is not None and cache_n is not None:
            self.prompt_tokens = prompt_n + cache_n
        if self.completion_tokens is None:
            self.completion_tokens = predicted_n
        if specx and _int(specx.get("steps")) is not None:
            self.steps = _int(specx.get("steps"))
        elif predicted_n is not None:  # each llama.cpp step emits its accepted draft tokens and one more
            self.steps = predicted_n - (_int(timings.get("draft_n_accepted")) or 0)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def base_url(url: str) -> str:
    """An OpenAI base URL (…/v1) from what a user typed, or ServerError.

    >>> base_url("http://127.0.0.1:8080"), base_url("http://gpu:8000/v1/")
    ('http://127.0.0.1:8080/v1', 'http://gpu:8000/v1')
    """
    try:
        parts = urllib.parse.urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"{url!r} is not an http(s) URL such as http://127.0.0.1:8080/v1")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def served_model(url: str, api_key: str | None = None, timeout: float = 10.0) -> str:
    """The first model a server lists (GET /v1/models): the name its requests must carry, or
    ServerError saying why the server cannot be used."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/models", headers=_headers(api_key)),
                                    timeout=timeout) as response:
            body = json.loads(response.read())
        return str(body["data"][0]["id"])
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}/models answered HTTP {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"cannot reach {url}: {getattr(reason, 'strerror', None) or reason}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{url}/models did not list a model: not an OpenAI-compatible server?") from None


KV_GAUGES = {"specx_kv_memory_budget_tokens": "kv_budget_tokens", "specx_kv_memory_tokens": "kv_kept_tokens",
             "specx_kv_evicted_tokens": "kv_evicted_tokens"}
PASS_GAUGES = {"specx_forward_seconds": "busy_s", "specx_forward_passes": "passes",
               'specx_forward_rows{kind="prefill"}': "prefill_rows", 'specx_forward_rows{kind="step"}': "step_rows"}


def server_gauges(url: str, api_key: str | None = None, timeout: float = 10.0) -> dict[str, float]:
    """What a server's /metrics says of the conversations' KV it keeps across turns (specx's
    `--kv-memory` gauges: budget, kept and pushed-out tokens) and of its batched passes (seconds
    the model computed, passes, rows of prefill and of steps, since it started); {} where it says
    nothing of them (another server, no /metrics, no access).
    """
    root = url[:-3] if url.endswith("/v1") else url
    try:
        with urllib.request.urlopen(urllib.request.Request(root + "/metrics", headers=_headers(api_key)),
                                    timeout=timeout) as response:
            return parse_gauges(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def parse_gauges(text: str) -> dict[str, float]:
    """The KV and pass gauges of a Prometheus text page, by their row names.

    >>> parse_gauges('# HELP x\\nspecx_kv_memory_tokens 1234.0\\nspecx_forward_rows{kind="step"} 7.0\\nother 5')
    {'kv_kept_tokens': 1234.0, 'step_rows': 7.0}
    """
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = KV_GAUGES.get(name) or PASS_GAUGES.get(name)
        if key is not None:
            found[key] = float(value)
    return found


def pass_use(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The pass gauges' growth over a run (seconds computed, passes, rows); {} where the server has none.

    >>> pass_use({"busy_s": 1.0, "passes": 2.0}, {"busy_s": 4.5, "passes": 10.0, "kv_kept_tokens": 3.0})
    {'busy_s': 3.5, 'passes': 8.0}
    """
    return {key: after[key] - before.get(key, 0.0) for key in PASS_GAUGES.values() if key in after}


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read())
        error = body.get("error", body)
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except (ValueError, OSError, AttributeError):
        return str(exc.reason)


def stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                api_key: str | None = None, timeout: float = 600.0) -> Answer:
    """POST /v1/chat/completions, streamed and greedy (temperature 0), usage asked for; a failed
    request is an Answer with `error` set, never an exception."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers=_headers(api_key))
    answer, parts = Answer(), []
    usage = timings = specx = None
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    answer.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
                    break
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if answer.ttft_s is None:
                            answer.ttft_s = time.perf_counter() - started
                        parts.append(piece)
                    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
                specx = event.get("specx") or specx
    except urllib.error.HTTPError as exc:
        answer.error = f"HTTP {exc.code}: {_error_message(exc)}"
    except (urllib.error.URLError, OSError, socket.timeout) as exc:
        answer.error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    except ValueError as exc:
        answer.error = f"not a chat completions stream: {exc}"
    answer.seconds = time.perf_counter() - started
    answer.text = "".join(parts)
    answer.read_usage(usage, timings, specx)
    return answer
