"""Prefix caching: the KV cache of recent prompts, reused by later prompts that start the same way.

An agent's calls share long prefixes (the system prompt, the tool list, the conversation so far; in
text-to-SQL the schema and the example pairs), and a prefill costs as much as many decode steps on
a CPU. Like a serving engine's prefix cache (vLLM, SGLang), `PrefixCache.prefill` copies the KV
entries of the longest prefix a stored prompt shares with the new one and runs the model only on
the rest; the new prompt's entries are then stored too (least recently used first out, within a
budget of tokens).

    prefixes = PrefixCache(max_tokens=8192)
    cache = prefixes.prefill(model, prompt_ids[:-1])   # a KV cache holding every token given

The reused entries are the ones an earlier prefill computed for the same tokens at the same
positions; a fresh prefill of the whole prompt would compute them in a larger batch, which can
differ from them in the last bits (as any two matrix kernels do), never more.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .transformers.kv_cache import cache_kwarg, full_attention, new_cache


class PrefixCache:
    """Stored prompts' KV entries (full-attention models; others are always prefilled whole)."""

    def __init__(self, max_tokens: int = 8192) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[int, tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]] = OrderedDict()
        self._next_key = 0
        self._held = 0
        self.hit_tokens = 0  # prompt tokens whose entries were copied instead of computed
        self.evicted_tokens = 0  # tokens of stored prompts pushed out to make room (prefilled again if asked for)
        self.miss_tokens = 0  # prompt tokens prefilled
        self.seconds = 0.0  # spent in prefill: copying stored entries and running the rest

    @property
    def num_tokens(self) -> int:
        """Tokens held (a running count: /metrics reads it from another thread while entries change)."""
        return self._held

    def longest_prefix(self, tokens: Sequence[int]) -> tuple[int, int | None]:
        """(length, entry key) of the longest prefix of `tokens` that a stored prompt starts with."""
        query = np.asarray(tokens, dtype=np.int64)
        best, best_key = 0, None
        for key, (stored, _) in self._entries.items():
            n = min(len(stored), len(query))
            differ = np.flatnonzero(stored[:n] != query[:n])
            shared = int(differ[0]) if len(differ) else n
            if shared > best:
                best, best_key = shared, key
        return best, best_key

    @torch.no_grad()  # not inference_mode: transformers' generate (no_grad) must be able to append to it
    def prefill(self, model: Any, tokens: Sequence[int], cache: Any = None) -> Any:
        """A KV cache (`cache`, or a new one) holding `tokens`: the longest stored prefix is copied,
        the rest run through `model`; then `tokens` are stored (when the budget allows)."""
        started = time.perf_counter()
        tokens = [int(t) for t in tokens]
        if cache is None:
            cache = new_cache(model)
        usable = self.max_tokens > 0 and full_attention(model.config)
        reuse, layers = self._claim(tokens, usable)
        for layer, (keys, values) in enumerate(layers or []):
            cache.update(keys[..., :reuse, :], values[..., :reuse, :], layer)
        if len(tokens) > reuse:
            ids = torch.tensor([tokens[reuse:]], dtype=torch.long, device=model.device)  # [1, S - reuse]
            # logits_to_keep=1: the prompt's logits are not needed, and all of them would be S x V floats
            model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
        self._keep(tokens, reuse, usable, cache)
        self.seconds += time.perf_counter() - started
        return cache

    def plan(self, tokens: Sequence[int]) -> int:
        """prefill's bookkeeping without a model (a cache of a full-attention model that only counts):
        how many of `tokens` would be prefilled; they are then held as prefill would hold them."""
        tokens = [int(t) for t in tokens]
        usable = self.max_tokens > 0
        reuse, _ = self._claim(tokens, usable)
        self._keep(tokens, reuse, usable, None)
        return len(tokens) - reuse

    def _claim(self, tokens: list[int], usable: bool) -> tuple[int, Any]:
        """(length, KV layers) of the longest stored prefix of `tokens`; an entry they extend (an
        agent's next turn) is dropped, for they replace it; another is marked recently used."""
        reuse, key = self.longest_prefix(tokens) if usable else (0, None)
        if key is None:
            return 0, None
        stored, layers = self._entries[key]
        if reuse == len(stored) < len(tokens):
            del self._entries[key]  # the new prompt extends it (an agent's next turn): it replaces it
            self._held -= len(stored)
        else:
            self._entries.move_to_end(key)
        return reuse, layers

    def _keep(self, tokens: list[int], reuse: int, usable: bool, cache: Any) -> None:
        self.hit_tokens += reuse
        self.miss_tokens += len(tokens) - reuse
        if usable and reuse < len(tokens) <= self.max_tokens:
            self._store(tokens, cache)

    def _store(self, tokens: list[int], cache: Any) -> None:
        layers = None if cache is None else [
            (layer.keys[..., : len(tokens), :].clone(), layer.values[..., : len(tokens), :].clone())
            for layer in cache.layers]
        self._add(tokens, layers)

    def _add(self, tokens: list[int], kept: Any) -> None:
        self._entries[self._next_key] = (np.asarray(tokens, dtype=np.int64), kept)
        self._next_key += 1
        self._held += len(tokens)
        self.evict()

    def evict(self) -> None:
        """Push out the least recently used prompts until the rest fit the budget."""
        while self._held > self.max_tokens:
            n = len(self._entries.popitem(last=False)[1][0])
            self._held -= n
            self.evicted_tokens += n


def kv_bytes_per_token(engine: Any) -> int:
    """What one position's keys and values take in `engine`'s caches, over all layers (0: not known,
    an engine that keeps its own cache): the engine's own figure, else a transformers model's config
    and dtype."""
    own = getattr(engine, "kv_bytes_per_token", None)
    if own is not None:
        return int(own)
    model = getattr(engine, "model", None)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return 0
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    size = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()
    return int(config.num_hidden_layers) * 2 * kv_heads * head_dim * size


def parse_bytes(text: str) -> int:
    """'2G', '512M', '1.5GB', '300KiB' or a plain number of bytes as bytes (powers of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: a number of bytes, or e.g. 512M, 2G")
    scale = 1024 ** " KMGT".index((match.group(2) or " ").upper())
    return int(float(match.group(1)) * scale)


def free_memory() -> int | None:
    """This machine's free memory in bytes, None where it cannot be read."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
