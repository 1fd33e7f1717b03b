"""Tree verification (SpecInfer): score a whole draft tree in one forward pass, walk it with the
greedy or sampling accept rule, and keep only the accepted path in the KV cache.

One pass reads the *pending* tokens (committed but not yet in the cache: usually the previous
step's bonus token) followed by every draft node. Worked example, cache of 5 tokens, pending
[a], draft [x, y, z] with parents [-1, 0, 0] (x, then two alternatives y | z after it):

    query   position   sees (besides the 5 cached tokens)
    a       5          a
    x       6          a x
    y       7          a x y
    z       7          a x     z

y and z share a position (both are depth 2) and never see each other, so each node's logits are
exactly those of the linear sequence prefix + its own path: lossless by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ..draft import Draft, check_draft
from ..model.attention import ATTENTION
from ..model.llamacpp import on_llamacpp
from .loop import TokenLogprob, Verdict

# Attention implementations that take an arbitrary additive 4D mask (ATTENTION: core.model.attention's); flash
# kernels only know causal/padding masks and flex attention wants a BlockMask.
_MASKABLE = ("sdpa", "eager", ATTENTION)


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


def tree_unsupported(model: Any) -> str | None:
    """Why this model cannot verify draft trees (None: it can). A tree pass needs an attention
    that takes an arbitrary 4D mask and a KV cache whose rows can be reordered: sliding-window
    layers (Gemma 2/3, Mistral's windowed layers) build their own masks and keep a rolling cache.
    Such a model verifies linear drafts (the tree's best path, core.decode.loop.best_path) with the
    model's own causal masks, its rejected tokens cropped off: the caller says so at load."""
    if on_llamacpp(model):
        return "on llama.cpp a pass costs nearly in proportion to its tokens (core/model/llamacpp.py)"
    config = model.config
    impl = getattr(config, "_attn_implementation", "sdpa")
    if impl not in _MASKABLE:
        return f"its attention implementation {impl!r} takes no tree mask (one of {', '.join(_MASKABLE)} does)"
    layer_types = getattr(config, "layer_types", None) or []
    windowed = any("sliding" in str(t) for t in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    if windowed:
        return (f"{type(model).__name__} has sliding-window attention layers (window "
                f"{getattr(config, 'sliding_window', '?')}), whose cache cannot be reordered for draft trees")
    return None


def tree_inputs(pending: Sequence[int], draft: Draft, num_cached: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, attention_mask) for one verification pass.

    attention_mask is additive (0 = attend, dtype's min = masked), shape [1, 1, Q, num_cached + Q],
    with Q = len(pending) + len(draft): transformers passes a 4D mask through unchanged to the
    sdpa and eager attention functions, and an additive float mask means the same to both.
    """
    num_pending, num_nodes = len(pending), len(draft)
    if num_pending < 1:
        raise ValueError("verification needs at least one pending token (the root's logits come from it)")
    q = num_pending + num_nodes
    input_ids = torch.tensor([list(pending) + list(draft.token_ids)], dtype=torch.long, device=device)  # [1, Q]
    depths = torch.tensor(draft.depths(), dtype=torch.long)  # [N]
    positions = torch.cat([torch.arange(num_pending), num_pending - 1 + depths]) + num_cached  # [Q]

    allowed = torch.zeros(q, num_cached + q, dtype=torch.bool)  # [Q, K]
    allowed[:, :num_cached] = True
    # pending tokens: plain causal attention among themselves; every node sees all of them
    allowed[:, num_cached : num_cached + num_pending] = torch.ones(q, num_pending, dtype=torch.bool).tril()
    ancestors = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)  # [N, N] row i: i and its ancestors
    for i, parent in enumerate(draft.parents):
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True
    allowed[num_pending:, num_cached + num_pending :] = ancestors

    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)
    mask.masked_fill_(allowed, 0.0)
    return input_ids, positions.unsqueeze(0).to(device), mask[None, None].to(device)  # [1, Q] [1, Q] [1, 1, Q, K]


def tree_logits(model: Any, cache: Any, pending: Sequence[int], draft: Draft) -> torch.Tensor:
    """Run the model over pending tokens + draft nodes, appending all of them to `cache`.

    Returns logits [P + N, V]: row P - 1 predicts the draft's roots, row P + i node i's children.
    A linear draft on a model that cannot verify trees (tree_unsupported) goes through with the
    model's own causal masks: the same attention, sliding windows included.
    """
    from ..model.kv_cache import cache_kwarg

    why = tree_unsupported(model)
    if why:
        if any(p != i - 1 for i, p in enumerate(draft.parents)):
            raise ValueError(f"this model verifies linear drafts only: {why}")
        ids = torch.tensor([list(pending) + list(draft.token_ids)], dtype=torch.long, device=model.device)  # [1, Q]
        return model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True).logits[0]  # [Q, V]
    input_ids, position_ids, mask = tree_inputs(pending, draft, cache.get_seq_length(), model.dtype, model.device)

    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits[0]  # [Q, V]


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


def keep_accepted(cache: Any, num_kept: int, accepted_nodes: Sequence[int], num_nodes: int) -> None:
    """Prune `cache` to its first `num_kept` entries (cache + pending) followed by the accepted
    nodes' entries, in path order: the cache plain decoding would hold.

    The draft's entries sit at num_kept + node index. A draft whose accepted path is its first
    nodes in order (always so for linear drafts) needs only a crop; otherwise the accepted rows
    are gathered into place first.
    """
    num_accepted = len(accepted_nodes)
    if list(accepted_nodes) != list(range(num_accepted)):
        src = torch.tensor(accepted_nodes, dtype=torch.long) + num_kept  # [A]
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            if getattr(layer, "is_sliding", False) or not isinstance(layer, DynamicLayer):
                raise ValueError(f"cannot reorder a {type(layer).__name__} cache layer; tree drafts need "
                                 "full-attention layers")
            idx = src.to(layer.keys.device)
            # the right-hand side is a gathered copy, so overlapping source and target is safe
            layer.keys[:, :, num_kept : num_kept + num_accepted] = layer.keys[:, :, idx]  # [B, H, A, D]
            layer.values[:, :, num_kept : num_kept + num_accepted] = layer.values[:, :, idx]
    # crop(0) leaves a full-attention layer as it is and trims a sliding one (recording its past,
    # core.model.kv_cache.new_cache) back to its window
    cache.crop(-(num_nodes - num_accepted))


@torch.inference_mode()
def verify(model: Any, cache: Any, pending: Sequence[int], draft: Draft, sampling: Sampling,
           allowed: Any = None, logprobs: int = -1) -> Verdict:
    """One speculative step: score pending + draft in one pass, accept, prune the cache.

    Afterwards the cache holds the pending tokens and the accepted draft tokens; the verdict's last
    token (the bonus) is the next step's pending token. `allowed` (a grammar's: bool [1 + N, V],
    core.decode.grammar.Constraint.allowed): the tokens each row may choose, the root's first; the others'
    logits become -inf before the walk, as constrained plain decoding masks them. `logprobs` >= 0:
    each chosen token's log-probability and that many top alternatives (Verdict.logprobs).
    """
    check_draft(draft, model.config.vocab_size)
    num_kept = cache.get_seq_length() + len(pending)
    logits = tree_logits(model, cache, pending, draft)  # [P + N, V]
    verdict = judge(logits[len(pending) - 1 :], draft, sampling, allowed, logprobs)
    keep_accepted(cache, num_kept, verdict.accepted_nodes, len(draft))
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
