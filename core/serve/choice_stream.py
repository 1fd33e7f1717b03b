"""One choice of a served request, decoded and streamed: the loop every entrance uses
(core.decode.generate) with the request's drafter, its text cut at its stop strings
(core.decode.text.TextStream), and each step's new text sent to the job as a Delta (events.py)
the moment the step ends, its tokens and logprobs with it.

A shaped stream (core/serve/pace.py: the job's pace) books each token a slot of its clock as it
goes out, and its drafts are capped by that clock (PacedCost): it drafts only where the decoding
is ahead of it. A client that went away (`job.cancelled`) ends the choice at its next
step, its decode closed without learning.
"""

from __future__ import annotations

import time
from typing import Any

from ..decode.generate import generate
from ..decode.loop import Decoded, collect
from ..decode.stack import Stack
from ..decode.text import TextStream
from .events import Choice, Delta
from .job import Job, prediction_tokens
from .pace import Clock, PacedCost


def stream_choice(job: Job, index: int, stack: Stack, drafter: Any, *, tokenizer: Any, vocabulary: Any,
                  acceptance: Any, prefix_cache: Any) -> Choice | None:
    """Choice `index` of `job`, decoded with `stack` and `drafter` (the request's: None, plain
    decoding), `acceptance` (its scope's model) and `prefix_cache` (its tenant's), streamed as
    deltas; None when the client went away. `tokenizer` turns the tokens into text; `vocabulary`
    (core.decode.grammar.Vocabulary) compiles the choice's grammar."""
    req = job.request
    settings = req.settings.for_choice(index)
    text = TextStream(tokenizer, stop=settings.stop)
    speculating = stack.drafter is not None
    cost = stack.cost if speculating else None
    clock = Clock.of(job.pace) if job.pace is not None else None  # the wire's, kept here too
    cost = PacedCost(cost, job.pace, clock) if clock is not None and cost is not None else cost  # drafts ahead of it
    steps = generate(stack.engine, req.prompt_ids, drafter, settings, stop=text,
                     constraint=settings.constraint(vocabulary), cost=cost,
                     acceptance=acceptance, prefix_cache=prefix_cache,
                     successors=stack.successors if speculating else None)
    sent = 0  # tokens whose text went out in a delta

    def stream(step: Any, run: Decoded) -> bool:
        nonlocal sent
        if job.cancelled.is_set():
            return False  # the decode is closed without learning
        piece = text.pop()
        if piece:
            if clock is not None:  # each token its slot, as the wire books them
                clock.book(len(run.tokens) - sent, time.monotonic())
            job.emit(Delta(index, piece, run.tokens[sent:], None if run.logprobs is None else run.logprobs[sent:]))
            sent = len(run.tokens)
        return True

    run = collect(steps, stream, logprobs=settings.logprobs >= 0)
    if run is None:
        return None
    tokens, logprobs = run.tokens, run.logprobs
    piece = text.pop(final=True)
    if piece or (logprobs and sent < len(tokens)):
        job.emit(Delta(index, piece, tokens[sent:], None if logprobs is None else logprobs[sent:]))
    return Choice(index, text.text, tokens, text.finish_reason(settings.max_new_tokens, settings.eos_token_ids),
                  run.stats, prediction_tokens(req.prediction_ids, tokens), logprobs)
