"""The decode loop every entrance uses: draft -> verify -> accept -> update, one Step per pass.

The verifier decides which tokens come next. `generate` (core/decode/generate.py) passes the model's
(`ModelVerifier`: one forward pass over the draft tree, the accept walk, the KV cache pruned);
model-free replay (core/predict/replay.py) passes the recording's (`RecordedVerifier`: the recorded output
is what the model writes). Both accept with the one walk, `Draft.walk`. Plain decoding is the
same loop with empty drafts (each step then emits exactly one token), so the speculative and the
plain path share every line that decides which token comes next. This module needs no torch:
model-free replay and the predictor run without it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..cost.acceptance import AcceptanceModel
from ..cost.forward import PassCost
from ..cost.sizing import size_draft
from ..draft import Draft, add_guesses, best_path, check_draft, forced_draft, limit_depth
from .speculate import Drafter


@dataclass
class Verdict:
    """Result of one verification: `tokens` = accepted draft tokens + one bonus token.

    `guesses`: the model's next token after each rejected child of the last accepted node (the
    argmax of that child's row). The child lost to the bonus token at the same position, and what
    the model writes after a near miss is often what it writes after the bonus token: `decode`
    adds the guesses to the next draft as roots (a Jacobi-style guess, free: those rows were
    computed anyway).
    """

    tokens: list[int]
    accepted_nodes: list[int]  # indices into the draft, root to leaf
    guesses: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the verifier was asked for them
    threads: int | None = None  # the thread count its pass ran on (the engine chose it: core.model.threads)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (its raw distribution, before a grammar's mask or
    the sampler's temperature and cuts, as vLLM reports them) and the `top` most likely tokens'."""

    logprob: float
    top: list[tuple[int, float]]


class Verifier(Protocol):
    """What the loop asks of a verifier: `start` once per request with its prompt, then `verify`
    each draft; `finished` says that nothing more can come (a recording's end); `vocab_size`
    (None: not checked) is what the drafter's tokens are checked against; `linear`: it verifies
    linear drafts only (the loop passes each tree's best path)."""

    finished: bool
    vocab_size: int | None
    linear: bool

    def start(self, prompt: list[int]) -> None: ...

    def verify(self, draft: Draft) -> Verdict: ...


@dataclass
class Step:
    """One verification pass: the tokens it emitted (accepted draft tokens + the bonus token, cut
    at EOS or max_new_tokens), the draft's size and how many of its nodes were accepted."""

    new_tokens: list[int]
    draft_size: int
    accepted: int
    draft_us: float  # time the drafter took to propose the draft (and the draft's sizing)
    verify_us: float  # the verifier: forward pass + accept walk + cache pruning
    update_us: float = 0.0  # the drafter learning the step's tokens
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for


@dataclass
class DecodeStats:
    """What decoding adds up to, over steps (`add_step`) or over calls (`add`): the one statistics
    type of generate, replay, the method comparison and the server."""

    calls: int = 0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0  # draft tokens accepted (bonus tokens not included)
    drafted: int = 0  # draft tokens verified
    draft_seconds: float = 0.0  # proposing drafts
    verify_seconds: float = 0.0  # verifying them
    update_seconds: float = 0.0  # the drafter's index updates: request start, appends, learning the output
    pass_seconds: float = 0.0  # with a cost curve: the verification passes' simulated time
    plain_seconds: float = 0.0  # with a cost curve: plain decoding's (one pass per output token)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted length -> steps

    def add_step(self, step: Step) -> None:
        self.tokens += len(step.new_tokens)
        self.steps += 1
        self.accepted += step.accepted
        self.drafted += step.draft_size
        self.draft_seconds += step.draft_us / 1e6
        self.verify_seconds += step.verify_us / 1e6
        self.update_seconds += step.update_us / 1e6
        self.accepted_hist[step.accepted] += 1

    def add(self, other: DecodeStats) -> None:
        for name in ("calls", "tokens", "steps", "accepted", "drafted", "draft_seconds", "verify_seconds",
                     "update_seconds", "pass_seconds", "plain_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_hist.update(other.accepted_hist)

    @property
    def accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        simulated = {"simulated_seconds": self.pass_seconds, "simulated_plain_seconds": self.plain_seconds,
                     "simulated_speedup": self.plain_seconds / self.pass_seconds} if self.pass_seconds else {}
        return simulated | {
            "calls": self.calls,
            "output_tokens": self.tokens,
            "steps": self.steps,
            "tokens_per_step": self.tokens / steps,
            "accepted_per_step": self.accepted / steps,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_draft_size": self.drafted / steps,
            "draft_us_per_token": 1e6 * self.draft_seconds / max(self.tokens, 1),
            "update_us_per_token": 1e6 * self.update_seconds / max(self.tokens, 1),
        }


@dataclass
class Decoded:
    """A decode run to its end (`collect`): its tokens, their logprobs (when the steps carry them),
    and its statistics."""

    tokens: list[int]
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None


def collect(steps: Iterator[Step], on_step: Callable[[Step, Decoded], bool | None] | None = None,
            logprobs: bool = False) -> Decoded | None:
    """Run a decode (`decode`'s or `generate`'s steps) to its end, adding up its tokens, logprobs
    and statistics: the one loop every caller needs. `on_step(step, so_far)` runs after each step is
    added (stream its text, time it, ...); when it returns False the decode is closed (its output
    not learned) and None comes back.

    >>> class Sevens:  # a verifier whose model writes 7 after anything
    ...     finished, linear, vocab_size = False, True, None
    ...     def start(self, prompt): pass
    ...     def verify(self, draft): return Verdict([7], [])
    >>> run = collect(decode(Sevens(), [1, 2], max_new_tokens=3))
    >>> run.tokens, run.stats.steps, run.stats.calls
    ([7, 7, 7], 3, 1)
    """
    run = Decoded([], DecodeStats(calls=1), [] if logprobs else None)
    try:
        for step in steps:
            run.stats.add_step(step)
            run.tokens += step.new_tokens
            if run.logprobs is not None:
                run.logprobs += step.logprobs
            if on_step is not None and on_step(step, run) is False:
                return None
    finally:
        steps.close()  # type: ignore[attr-defined]
    return run


def decode(verifier: Verifier, prompt: Sequence[int], drafter: Drafter | None = None,
           max_new_tokens: int | None = None, eos: Iterable[int] = (), cost: PassCost | None = None,
           stop: Callable[[list[int]], int | None] | None = None, acceptance: AcceptanceModel | None = None,
           learn: bool = True, constraint: Any = None) -> Iterator[Step]:
    """Decode after `prompt` until EOS, `max_new_tokens` (None: until the verifier is finished) or
    `stop`, yielding one Step per verification pass.

    `drafter` (a core.decode.speculate.Drafter) is driven through a request: start_request(prompt),
    speculate() before each pass, extend(tokens) after it, finish_request(learn) at the end (learn
    only when decoding ran to its end and `learn`). With `cost` (a forward-pass cost curve) each
    draft is cut to the size that pays (core.cost.sizing.size_draft), and `acceptance` learns from the
    verdicts what the drafts are worth (a server or a benchmark passes one for all requests; by
    default each request starts afresh). `stop` (e.g. a text.TextStream) sees each step's tokens
    and returns None to go on or how many of them to keep: decoding then ends there, as at EOS.
    `constraint` (a core.decode.grammar.Constraint, which the verifier applies too): the tokens its grammar
    forces lead each draft (speculative decoding only) and the nodes it refuses are pruned.

    Every step is shown to `cost` (`observe_step`): a core.cost.learned.LearnedCost learns from it
    what passes cost (its shape) and whether the drafts pay (its guard caps them, `max_draft`, when
    they do not); a fixed curve ignores it. Each step's timing is tagged with the thread count its
    pass ran on (Verdict.threads): passes on different counts are not compared.
    """
    prompt = [int(t) for t in prompt]
    if max_new_tokens is not None and max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = set(eos)
    if acceptance is None and cost is not None:
        acceptance = AcceptanceModel()  # adaptive draft size: each node's chance, learned from verdicts
    clock = time.perf_counter
    if drafter is not None:
        drafter.start_request(prompt)
    learned = False
    try:
        verifier.start(prompt)
        num_out = 0
        guesses: list[int] = []  # the model's own guesses from the last pass (speculative decoding only)
        while (max_new_tokens is None or num_out < max_new_tokens) and not verifier.finished:
            start = clock()
            context = len(prompt) + num_out
            cap = cost.max_draft() if cost is not None else None
            # a step the learned cost keeps plain drafts nothing (sizing would cut it all: exact)
            proposed = drafter.speculate() if drafter is not None and cap != 0 else Draft()
            draft = shape_draft(proposed, verifier, guesses=guesses, constraint=constraint,
                                lead_forced=drafter is not None,
                                tokens_left=None if max_new_tokens is None else max_new_tokens - num_out,
                                cost=cost, acceptance=acceptance, context=context, max_nodes=cap)
            drafted = clock()
            verdict = verifier.verify(draft)
            verified = clock()
            tokens = verdict.tokens if max_new_tokens is None else verdict.tokens[: max_new_tokens - num_out]
            done = False
            if eos:
                for i, tok in enumerate(tokens):
                    if tok in eos:  # the model stopped: nothing after EOS is output, drafted or not
                        tokens, done = tokens[: i + 1], True
                        break
            if stop is not None:
                keep = stop(tokens)
                if keep is not None:
                    tokens, done = tokens[:keep], True
            num_out += len(tokens)
            if cost is not None and len(draft):
                acceptance.update(draft, verdict.accepted_nodes)
            updated = clock()
            if drafter is not None:
                drafter.extend(tokens)
                guesses = verdict.guesses
            finished = clock()
            if cost is not None:
                cost.observe_step(num_tokens=1 + len(draft), context=context, verify_seconds=verified - drafted,
                                  step_seconds=finished - start, num_out=len(tokens), tag=verdict.threads)
            yield Step(tokens, len(draft), min(verdict.num_accepted, len(tokens)), (drafted - start) * 1e6,
                       (verified - drafted) * 1e6, (finished - updated) * 1e6,
                       None if verdict.logprobs is None else verdict.logprobs[: len(tokens)])
            if done:
                break
        learned = learn
    finally:
        if drafter is not None:
            drafter.finish_request(learned)


def shape_draft(draft: Draft, verifier: Verifier, *, guesses: Sequence[int] = (), constraint: Any = None,
                lead_forced: bool = False, tokens_left: int | None = None, cost: PassCost | None = None,
                acceptance: AcceptanceModel | None = None, context: int | None = None,
                max_nodes: int | None = None) -> Draft:
    """The drafter's tree, made into what the verifier runs this pass. Each change is optional and
    they run in this order, for the reason given:

    1. checked: every token must be an id the model has (`check_draft`), before anything builds on it;
    2. the model's guesses from the last pass join as roots (`add_guesses`): before the cuts below,
       so that they compete with the drafter's nodes;
    3. the tokens the grammar forces lead the tree (`lead_forced`: speculative decoding only), the draft
       below them: before the best path is taken, so that the path runs through them;
    4. a verifier that takes linear drafts gets the best path (`best_path`): once every node is in;
    5. no node deeper than the tokens left (`limit_depth`: a step emits at most accepted + 1): before
       sizing, which must not pay for nodes that cannot be output;
    6. cut to the size that pays on the cost curve (`size_draft`), with each node's chance from
       `acceptance`, at most `max_nodes` (the learned cost's guard): after every change of shape,
       as it weighs the tree the verifier would run;
    7. the nodes the grammar refuses pruned (`constraint.prune`): last, as it walks the grammar
       over every node, on the smallest tree.
    """
    if verifier.vocab_size is not None:
        check_draft(draft, verifier.vocab_size)
    if guesses:
        draft = add_guesses(draft, guesses)
    if lead_forced and constraint is not None:
        forced = constraint.forced()
        if forced:
            draft = forced_draft(forced).merge(draft, len(forced) + len(draft))
    if verifier.linear:
        draft = best_path(draft, acceptance.estimates(draft) if acceptance is not None else None)
    if tokens_left is not None:
        draft = limit_depth(draft, tokens_left - 1)
    if cost is not None:
        draft = size_draft(draft, cost, 1, acceptance=acceptance, context=context, max_nodes=max_nodes,
                           others=cost.others())
    if constraint is not None:
        draft = constraint.prune(draft)
    return draft
