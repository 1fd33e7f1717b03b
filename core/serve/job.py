"""What the worker decodes and how it answers: a validated request (GenerationRequest), the Job
that carries it through the worker with the channel its events go back on, the tokenizer behind
a lock, and the prediction's accounting. Where finished requests go is core/serve/keeper.py's."""

from __future__ import annotations

import asyncio
import difflib
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..decode.request import Decoding
from .events import Event
from .pace import Pace


@dataclass
class GenerationRequest:
    """A validated request: what to decode (`settings`: the limit, end tokens, sampling, stop
    strings, grammar and logprobs, made once from the HTTP body and handed to generate as they
    are) and what the server does around it."""

    id: str
    endpoint: str  # "chat.completions" or "completions"
    model: str  # the name the client asked for
    prompt_ids: list[int]
    settings: Decoding  # core.decode.request: each choice decodes settings.for_choice(its index)
    prompt_messages: list[dict[str, Any]] | None = None  # chat
    prompt_text: str | None = None  # completions
    n: int = 1
    prediction_ids: list[int] | None = None  # OpenAI's Predicted Outputs: the first draft source
    grammar_param: str | None = None  # the request's param the settings' grammar came from (named when it fails)
    tool_parser: str | None = None  # the output may hold tool calls in this core.serve.tools format
    tool_names: list[str] | None = None  # of the request's functions
    tenant: str = ""  # whose key sent it ('': a server without tenants): what it drafts from and teaches


class Job:
    """A request on its way through the worker, and the channel its events come back on."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued = time.perf_counter()
        self.pace: Pace | None = None  # a shaped stream's clock (core/serve/pace.py): the worker drafts ahead of it

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


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


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
