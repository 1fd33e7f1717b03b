"""**Grouped-query attention with a mask.** transformers copies the key/value heads once per query
head (`repeat_kv`) whenever a mask is passed, i.e. on every tree verification. `gqa_attention`
instead folds the query heads that share a key/value head into extra query rows, the way
transformers already does for a single query token.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "specx_sdpa"

_packed: dict[str, Any] = {"mask": None, "groups": 0, "packed": None}


def gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """sdpa attention for query [B, H, Q, D] over key/value [B, Hkv, K, D] without repeating the
    key/value heads: the H / Hkv query heads that share a key/value head become extra query rows
    (row order head-major, so the mask [B, 1, Q, K] is tiled once per head). Same per-row math as
    transformers' sdpa path; anything else (one query token, no grouping, no mask) goes there."""
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if groups == 1 or q_len == 1 or attention_mask is None or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # every layer gets the same mask object: tile it once per forward pass
    if _packed["mask"] is not attention_mask or _packed["groups"] != groups:
        _packed.update(mask=attention_mask, groups=groups, packed=attention_mask.repeat(1, 1, groups, 1))
    folded = query.reshape(batch, key.shape[1], groups * q_len, dim)  # [B, Hkv, G*Q, D]
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=_packed["packed"],
                                                           scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None  # [B, Q, H, D]


def install() -> None:
    """Register `gqa_attention` with transformers under the name ATTENTION (a model then selects it
    with `set_attn_implementation(ATTENTION)`), with sdpa's masks: without them transformers passes no
    mask at all to an attention function it does not know, and sdpa then reads "no mask, several
    queries" as a causal prefill."""
    AttentionInterface.register(ATTENTION, gqa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
