"""The prefix cache on transformers: core.model.prefix_cache.PrefixCache whose stored prompts are
copies of a transformers KV cache's layers.

    prefixes = TransformersPrefixCache(max_tokens=8192)   # or engine.new_prefix_cache(8192)
    cache = prefixes.prefill(model, prompt_ids[:-1])   # a KV cache holding every token given

Only full-attention models reuse entries; others are always prefilled whole. The reused entries are
the ones an earlier prefill computed for the same tokens at the same positions; a fresh prefill of
the whole prompt would compute them in a larger batch, which can differ from them in the last bits
(as any two matrix kernels do), never more.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..prefix_cache import PrefixCache, Turn
from .kv_cache import cache_kwarg, full_attention, new_cache


class TransformersPrefixCache(PrefixCache):
    """PrefixCache on transformers' KV caches (core.model.transformers.kv_cache.new_cache's): a stored
    prompt keeps a copy of its keys and values per layer, not the session's cache, which the session
    goes on changing in place (full-attention models; others are always prefilled whole)."""

    @torch.no_grad()  # not inference_mode: transformers' generate (no_grad) must be able to append to it
    def prefill(self, model: Any, tokens: Sequence[int], cache: Any = None) -> Any:
        """A KV cache (`cache`, or a new one) holding `tokens`: the longest stored prefix is copied,
        the rest run through `model`; then `tokens` are stored (when the budget allows)."""
        started = time.perf_counter()
        tokens = [int(t) for t in tokens]
        if cache is None:
            cache = new_cache(model)
        usable = self.max_tokens > 0 and full_attention(model.config)
        reuse, layers, turn = self._claim(tokens, usable)
        for layer, (keys, values) in enumerate(layers or []):
            cache.update(keys[..., :reuse, :], values[..., :reuse, :], layer)
        if len(tokens) > reuse:
            ids = torch.tensor([tokens[reuse:]], dtype=torch.long, device=model.device)  # [1, S - reuse]
            # logits_to_keep=1: the prompt's logits are not needed, and all of them would be S x V floats
            model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
        self._keep(tokens, reuse, usable, cache, turn)
        self.seconds += time.perf_counter() - started
        return cache

    def _store(self, tokens: list[int], cache: Any, turn: Turn) -> None:
        layers = None if cache is None else [
            (layer.keys[..., : len(tokens), :].clone(), layer.values[..., : len(tokens), :].clone())
            for layer in cache.layers]
        self._add(tokens, layers, turn)
