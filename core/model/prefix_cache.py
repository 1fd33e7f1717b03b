"""Prefix caching: the KV entries of recent prompts, reused by later prompts that start the same way.

An agent's calls share long prefixes (the system prompt, the tool list, the conversation so far; in
text-to-SQL the schema and the example pairs), and a prefill costs as much as many decode steps on
a CPU. Like a serving engine's prefix cache (vLLM, SGLang), a prefill through the cache copies the
KV entries of the longest prefix a stored prompt shares with the new one and runs the model only
on the rest; the new prompt's entries are then stored too, within a budget of tokens.

What goes out first when the budget is full is the entry whose next use is furthest away, as far as
its own past says: a conversation whose turns came every g claims of the cache is expected back g
claims after its last (agents taking turns in a cycle: the one that just had its turn comes back
last, and least recently used would push out the next one to come, so that no turn reused anything
once the conversations outgrew the budget); an entry of no known pace, or one overdue, as long
again as it has been idle (least recently used among those). A conversation's pace is learned when
its next turn comes, from its entry or, if that was pushed out, from the trace it left (its length
and a hash of its tokens, the last GONE_TRACES of them). The clock counts the cache's own prefills,
not seconds: the order depends on nothing else the server does.

`PrefixCache` here is the part every engine shares: the stored prompts, the budget, the longest
shared prefix, eviction and the counters; what an engine keeps of a prompt's entries it holds
without looking inside. Each engine that reuses prefixes has its own kind, with the `prefill` that
copies and runs (core.model.transformers.prefix_cache.TransformersPrefixCache,
core.model.quantized.engine.QuantPrefixCache, core.model.gpu.engine.GPUPrefixCache); the engine's
`new_prefix_cache` makes one:

    prefixes = engine.new_prefix_cache(8192)
    session = engine.start(prompt_ids[:-1], prefixes)   # the longest stored prefix copied, the rest run

A kind's prefill claims the longest stored prefix (`_claim`, which also says the claim's turn: its
time and its conversation's pace), copies that many entries of what was kept and runs the rest, then
counts and stores the prompt (`_keep`, which calls its `_store`).
`plan` is the same bookkeeping without a model. Also here, for sizing the budget from memory:
kv_bytes_per_token, parse_bytes, free_memory.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

GONE_TRACES = 256  # entries pushed out whose pace a later turn may still learn (a length and a hash each)


class Turn(NamedTuple):
    """When an entry was last used, in claims of its cache, and the claims between its last two
    uses (None: used once): its conversation's pace."""
    at: int
    gap: int | None = None


class PrefixCache:
    """Stored prompts (their token ids) and what an engine kept of their KV entries, at most
    `max_tokens` tokens of them; an engine's kind (see the module) prefills through it."""

    def __init__(self, max_tokens: int = 8192) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[int, tuple[np.ndarray, Any]] = OrderedDict()
        self._turns: dict[int, Turn] = {}  # each entry's last use and pace
        self._clock = 0  # claims so far
        self._gone: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) of entries pushed out: last use
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

    def plan(self, tokens: Sequence[int]) -> int:
        """prefill's bookkeeping without a model (a cache of a full-attention model that only counts):
        how many of `tokens` would be prefilled; they are then held as prefill would hold them."""
        tokens = [int(t) for t in tokens]
        usable = self.max_tokens > 0
        reuse, _, turn = self._claim(tokens, usable)
        self._keep(tokens, reuse, usable, None, turn)
        return len(tokens) - reuse

    def _claim(self, tokens: list[int], usable: bool) -> tuple[int, Any, Turn]:
        """(length, what was kept, this prefill's Turn) of the longest stored prefix of `tokens`. An
        entry they extend (an agent's next turn) is dropped, for they replace it, and its pace goes
        on in the Turn; one they repeat whole is used again (its pace learned); another, of which
        they share a part, is marked recently used."""
        self._clock += 1
        reuse, key = self.longest_prefix(tokens) if usable else (0, None)
        stored, kept = self._entries[key] if key is not None else (None, None)
        whole = stored is not None and reuse == len(stored)
        turn = Turn(self._clock, self._clock - self._turns[key].at) if whole else self._traced(tokens, reuse)
        if stored is None:
            return 0, None, turn
        if reuse == len(stored) < len(tokens):
            del self._entries[key]  # the new prompt extends it (an agent's next turn): it replaces it
            del self._turns[key]
            self._held -= len(stored)
        else:
            self._entries.move_to_end(key)
            if whole:
                self._turns[key] = turn
        return reuse, kept, turn

    def _traced(self, tokens: list[int], reuse: int) -> Turn:
        """This claim's Turn, its pace from the longest entry pushed out that `tokens` start with,
        if one is longer than the `reuse` a stored entry gives (its trace is then dropped)."""
        query = np.asarray(tokens, dtype=np.int64)
        for n, digest in sorted(self._gone, reverse=True):
            if reuse < n <= len(query) and _digest(query[:n]) == digest:
                return Turn(self._clock, self._clock - self._gone.pop((n, digest)))
        return Turn(self._clock)

    def _keep(self, tokens: list[int], reuse: int, usable: bool, cache: Any, turn: Turn) -> None:
        """Count a prefill of `tokens` that copied `reuse` of them, and store them (`_store`) when
        the cache is usable and they fit the budget; `cache`: the KV cache the prefill made; `turn`:
        its claim's."""
        self.hit_tokens += reuse
        self.miss_tokens += len(tokens) - reuse
        if usable and reuse < len(tokens) <= self.max_tokens:
            self._store(tokens, cache, turn)

    def _store(self, tokens: list[int], cache: Any, turn: Turn) -> None:
        """Keep, through `_add`, what a later prompt that starts with `tokens` will copy of `cache`
        (None from `plan`: nothing to keep). Here `cache` itself; a kind whose sessions go on
        changing their prompt's entries keeps a copy of them instead."""
        self._add(tokens, cache, turn)

    def _add(self, tokens: list[int], kept: Any, turn: Turn) -> None:
        self._entries[self._next_key] = (np.asarray(tokens, dtype=np.int64), kept)
        self._turns[self._next_key] = turn
        self._next_key += 1
        self._held += len(tokens)
        self.evict()

    def next_use(self, key: int) -> int:
        """When the entry `key` is expected to be used again, in claims: its last use + its pace while
        that lies ahead, else (no pace known, or overdue) now + as long as it has been idle."""
        at, gap = self._turns[key]
        if gap is not None and at + gap >= self._clock:
            return at + gap
        return 2 * self._clock - at

    def evict(self) -> None:
        """Push out the entries expected back last (`next_use`; the least recently used first among
        equals) until the rest fit the budget."""
        while self._held > self.max_tokens:
            key = max(self._entries, key=self.next_use)  # max keeps the first (least recent) of equals
            stored = self._entries.pop(key)[0]
            n = len(stored)
            self._gone[(n, _digest(stored))] = self._turns.pop(key).at
            while len(self._gone) > GONE_TRACES:
                self._gone.popitem(last=False)
            self._held -= n
            self.evicted_tokens += n


def _digest(tokens: Sequence[int] | np.ndarray) -> int:
    return hash(np.asarray(tokens, dtype=np.int64).tobytes())


def kv_bytes_per_token(engine: Any) -> int:
    """What one position's keys and values take in `engine`'s caches, over all layers: the engine's
    own figure (its `kv_bytes_per_token`), 0 where it has none (an engine that keeps its own cache)."""
    return int(getattr(engine, "kv_bytes_per_token", None) or 0)


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
