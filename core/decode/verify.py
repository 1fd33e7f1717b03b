"""Judging a verification pass: the accept walk (greedy or sampling) over a draft tree's logits,
whatever engine computed them (the passes themselves: core.model.engine; on transformers, the tree
pass of core.model.transformers.tree).

The walk starts at the root row (the last pending token's: it predicts the draft's roots) and moves
to the child that carries the token plain decoding would choose there; the first token no child
carries is the bonus token. Greedy output therefore equals plain greedy decoding, and sampling
draws every token from exactly the target distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..draft import Draft
from ..index.successors import SuccessorTable
from ..model.engine import Session
from .loop import TokenLogprob, Verdict

# Temperatures below this decode greedily: dividing logits by 1e-320 (a subnormal) overflows to
# inf, and softmax of infs is NaN, which sampled garbage; well before that, sampling at such a
# temperature is the argmax but for exact ties.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 (below MIN_TEMPERATURE) is greedy (argmax);
    otherwise the processed distribution (temperature, then top-k, then top-p) is sampled with
    `generator`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature >= MIN_TEMPERATURE  # NaN too


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution for one row of logits [V] -> probs [V] (float64).

    Temperature first, then top-k, then top-p (nucleus: the smallest set of most likely tokens
    whose mass reaches top_p), the order transformers' samplers apply them in. Plain decoding in
    `generate` uses this same function, which is what makes speculative sampling lossless.
    """
    scores = logits.double() / sampling.temperature  # [V]
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)  # [V]
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p; the first always stays
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= sampling.top_p
        drop_sorted[0] = False
        scores = scores.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return scores.softmax(-1)


def row_argmax(logits: torch.Tensor) -> Any:
    """The argmax of each row of logits [..., V] as Python ints (an int for one row), the first
    maximal index as torch.argmax gives it. On CPU numpy's argmax does it: torch's takes ~75 us
    per row of the built-in model's 49,152 logits, numpy's ~5."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def choose_token(logits: torch.Tensor, sampling: Sampling) -> int:
    """The token the plain decoder would emit from these logits [V].

    Sampling draws exactly one uniform number per token (inverse CDF), so plain and speculative
    decoding consume the generator identically and, with the same seed, write the same text.
    """
    if sampling.greedy:
        return row_argmax(logits)
    probs = process_logits(logits, sampling)  # [V]
    u = torch.rand((), dtype=torch.float64, generator=sampling.generator)
    cdf = probs.cumsum(-1)
    if not float(cdf[-1]) > 0.0:  # NaN: the search below would return a token the row gives no chance (issue 59)
        raise RuntimeError("no token can be sampled: the row's logits are -inf or NaN wherever they are allowed")
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)[0])
    idx = min(idx, probs.numel() - 1)
    while probs[idx] == 0:  # rounding at the top of the CDF: step back to a token that can occur
        idx -= 1
    return idx


def accept(logits: torch.Tensor, draft: Draft, root_row: int, sampling: Sampling,
           argmax: Sequence[int] | None = None) -> Verdict:
    """Walk the draft from the root: choose a token at the current node as plain decoding would;
    move to the child that carries it, else emit it as the bonus token and stop.

    For a draft that does not depend on the model's randomness this emits tokens with exactly the
    target distribution (every token is a plain draw), and greedy equals plain greedy. `argmax`:
    row_argmax(logits[root_row:]) when the caller has it already (greedy only).
    """
    if sampling.greedy and argmax is None:
        argmax = row_argmax(logits[root_row:])  # greedy: every row's choice at once

    def choose(node: int, depth: int) -> int:  # the token plain decoding would choose after `node`
        row = 0 if node < 0 else 1 + node
        return argmax[row] if sampling.greedy else choose_token(logits[root_row + row], sampling)

    return Verdict(*draft.walk(choose))


def mask_logits(logits: torch.Tensor, allowed: Any) -> None:
    """Set logits [R, V'] to -inf where `allowed` (bool [R, V], numpy or torch) is false, in place;
    columns past V (a model's padded vocabulary) are refused too."""
    allowed = torch.as_tensor(allowed, device=logits.device)
    width = allowed.shape[-1]
    logits[..., :width].masked_fill_(~allowed, float("-inf"))
    logits[..., width:] = float("-inf")


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of logits [T, V] chose tokens[i]: its log-probability and the `top` best alternatives."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # [T, V]
    chosen = logp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()
    if top <= 0:
        return [TokenLogprob(lp, []) for lp in chosen]
    values, ids = torch.topk(logp, top, dim=-1)  # [T, top]
    return [TokenLogprob(lp, list(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


@torch.inference_mode()
def verify(session: Session, pending: Sequence[int], draft: Draft, sampling: Sampling, *, allowed: Any = None,
           logprobs: int = -1, successors: SuccessorTable | None = None) -> Verdict:
    """One speculative step: score pending + draft in one pass of `session` (an engine's request,
    core.model.engine.Session), judge it, keep the accepted path in its cache.

    Afterwards the cache holds the pending tokens and the accepted draft tokens; the verdict's last
    token (the bonus) is the next step's pending token. `allowed` (a grammar's: bool [1 + N, V],
    core.decode.grammar.Constraint.allowed): the tokens each row may choose, the root's first; the others'
    logits become -inf before the walk, as constrained plain decoding masks them. `logprobs` >= 0:
    each chosen token's log-probability and that many top alternatives (Verdict.logprobs).
    `successors`: the rows' most likely next tokens go into this table (learn_successors): every
    row's on an accelerator, on the CPU those of the root and the accepted path.
    """
    logits = session.score(pending, draft)
    raw = logits.clone() if successors is not None and allowed is not None else logits  # judge masks in place
    verdict = judge(logits, draft, sampling, allowed, logprobs)
    if successors is not None:
        inputs = [pending[-1], *draft.token_ids]
        # On the CPU each row's top-k costs ~0.4 ms (a 64-token pass ~60 ms): only the rows read in the
        # output's own context (the root and the accepted path); on an accelerator every row.
        rows = list(range(len(inputs))) if logits.device.type != "cpu" else [0, *(1 + i for i in verdict.accepted_nodes)]
        learn_successors(successors, [inputs[r] for r in rows], raw[rows])
    session.keep_path(verdict.accepted_nodes)
    return verdict


def judge(logits: torch.Tensor, draft: Draft, sampling: Sampling, allowed: Any = None,
          logprobs: int = -1) -> Verdict:
    """The verdict on `draft` from its verification pass's logits [1 + N, V] (row 0 predicts the
    roots, row 1 + i node i's children), whatever engine computed them: the grammar's mask, the
    accept walk, the model's guesses after the rejected children, the log-probabilities. The
    logits are masked in place."""
    raw = logits.clone() if logprobs >= 0 and allowed is not None else logits
    if allowed is not None:
        mask_logits(logits, allowed)
    argmax = row_argmax(logits) if sampling.greedy else None  # the walk's and the guesses'
    verdict = accept(logits, draft, 0, sampling, argmax)
    last = verdict.accepted_nodes[-1] if verdict.accepted_nodes else -1
    rejected = [i for i, parent in enumerate(draft.parents) if parent == last]
    if rejected:
        guesses = ([argmax[1 + i] for i in rejected] if argmax is not None
                   else row_argmax(logits[[1 + i for i in rejected]]))
        verdict.guesses = list(dict.fromkeys(guesses))
    if logprobs >= 0:
        verdict.logprobs = token_logprobs(raw[[0] + [1 + i for i in verdict.accepted_nodes]], verdict.tokens, logprobs)
    return verdict


def learn_successors(table: SuccessorTable, inputs: Sequence[int], logits: torch.Tensor) -> None:
    """Each row of a pass's logits [R, V] (the model's raw distribution after `inputs` [R]: the last
    pending token, then each draft node) gives its input token's entry in `table`: its k most
    likely next tokens and their probabilities (Token Recycling's update)."""
    values, ids = torch.topk(logits, table.k, dim=-1)  # [R, k]
    probs = torch.exp(values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True))  # [R, k]
    table.learn(inputs, ids.cpu().numpy(), probs.cpu().numpy())
