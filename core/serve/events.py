"""What the worker tells the HTTP side about a job: typed events on the job's queue, and the Choice.

The worker (worker.py; a choice's deltas, choice_stream.py) sends them from its thread through
`Job.emit`; the HTTP side (cli/http/delivery.py) matches them by type:

    Delta(index, text, tokens, logprobs)   new text of choice `index`, safe to show (stop strings
                                           held back), the tokens decoded since the last delta and
                                           their TokenLogprobs (None when the request asked none)
    ChoiceDone(choice)                     a choice finished
    Done(stats)                            the request finished (after all its choices)
    Failed(status, message, param)         it failed: the HTTP status, why, and the request's
                                           parameter at fault (None: none is)
    Cancelled()                            the client went away (sent by the HTTP side itself, to
                                           end its own wait; the worker sees `job.cancelled`)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.loop import DecodeStats, TokenLogprob
from .metrics import Stats


@dataclass
class Choice:
    """One finished choice of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: DecodeStats  # its steps, drafts and seconds
    prediction_tokens: tuple[int, int] = (0, 0)  # of the prediction: (appeared in the output, did not)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class ChoiceDone:
    choice: Choice


@dataclass(frozen=True)
class Done:
    stats: Stats


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    param: str | None = None


@dataclass(frozen=True)
class Cancelled:
    pass


Event = Delta | ChoiceDone | Done | Failed | Cancelled
