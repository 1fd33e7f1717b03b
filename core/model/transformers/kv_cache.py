"""**The KV cache.** `DynamicCache` appends with `torch.cat`, copying the whole cache every step.
`GrowingCache` writes new entries into a buffer that doubles when full.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of a buffer that doubles when full: a step
    writes its new entries in place instead of concatenating (copying) the whole cache.
    Cropping shortens the views; the next update writes after them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._buffers = None
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            shape = (*key_states.shape[:-2], max(256, 2 * end), key_states.shape[-1])
            grown = tuple(torch.empty(shape, dtype=key_states.dtype, device=key_states.device) for _ in range(2))
            if start:
                grown[0][..., :start, :] = self.keys
                grown[1][..., :start, :] = self.values
            self._buffers = grown
        keys, values = self._buffers
        keys[..., start:end, :] = key_states
        values[..., start:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers (full attention only: no sliding-window layers)."""

    def __init__(self) -> None:
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def cache_kwarg(model: Any) -> str:
    """The keyword a model's forward (and generate) takes its KV cache by: `cache` in transformers
    5.2x, which deprecates `past_key_values` (removed in 5.40), `past_key_values` before."""
    return _cache_kwarg(type(model))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def full_attention(config: Any) -> bool:
    """Whether every layer attends to the whole sequence (no sliding window)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return not getattr(config, "sliding_window", None) and all(t == "full_attention" for t in layer_types)


def new_cache(model: Any) -> Any:
    """The KV cache to decode `model` with: a GrowingCache when every layer is full attention;
    else transformers' own, recording its sliding layers' past, so that a pass's rejected draft
    tokens can be cropped off again (linear drafts: core.model.transformers.tree.keep_accepted)."""
    if full_attention(model.config):
        return GrowingCache()
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache
