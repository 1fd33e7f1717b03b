"""Tree passes on transformers (SpecInfer): score a whole draft tree in one forward pass and keep
only the accepted path in the KV cache.

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
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from ...draft import Draft
from .attention import ATTENTION
from .kv_cache import cache_kwarg

# Attention implementations that take an arbitrary additive 4D mask (ATTENTION: this package's attention.py);
# flash kernels only know causal/padding masks and flex attention wants a BlockMask.
_MASKABLE = ("sdpa", "eager", ATTENTION)


def tree_unsupported(model: Any) -> str | None:
    """Why this transformers model cannot verify draft trees (None: it can). A tree pass needs an
    attention that takes an arbitrary 4D mask and a KV cache whose rows can be reordered:
    sliding-window layers (Gemma 2/3, Mistral's windowed layers) build their own masks and keep a
    rolling cache. Such a model verifies linear drafts (the tree's best path,
    core.draft.best_path) with the model's own causal masks, its rejected tokens cropped off."""
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


def tree_logits(model: Any, cache: Any, pending: Sequence[int], draft: Draft, *, linear: str | None) -> torch.Tensor:
    """Run the model over pending tokens + draft nodes, appending all of them to `cache`.

    Returns logits [P + N, V]: row P - 1 predicts the draft's roots, row P + i node i's children.
    `linear`: why the model cannot verify trees (tree_unsupported(model), asked once per model),
    None when it can; a linear draft then goes through with the model's own causal masks: the same
    attention, sliding windows included.
    """
    if linear:
        if any(p != i - 1 for i, p in enumerate(draft.parents)):
            raise ValueError(f"this model verifies linear drafts only: {linear}")
        ids = torch.tensor([list(pending) + list(draft.token_ids)], dtype=torch.long, device=model.device)  # [1, Q]
        return model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True).logits[0]  # [Q, V]
    input_ids, position_ids, mask = tree_inputs(pending, draft, cache.get_seq_length(), model.dtype, model.device)

    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits[0]  # [Q, V]


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
    # core.model.transformers.kv_cache.new_cache) back to its window
    cache.crop(-(num_nodes - num_accepted))
