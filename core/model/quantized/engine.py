"""specx's own engine for GGUF files: the file's quantized weights as they are, verified in trees.

    engine = QuantEngine("model.Q4_K_M.gguf")     # or load_backend(path, backend="quantized")
    session = engine.start(prompt_ids[:-1], engine.new_prefix_cache(8192))
    logits = session.score([prompt_ids[-1]], draft)   # [1 + N, V], as every engine's
    session.keep_path(accepted_nodes)

The weights stay in the file's blocks (core/model/quantized/quant.py repacks them, never to floats), each
linear layer runs core/model/quantized/kernel.py's kernel (a weight read once per pass, whatever the
rows), the rest core/model/quantized/forward.py's row-wise steps. Every step is batch-invariant, so a
verification pass gives each token the bits a one-token pass gives it: greedy speculation is this
engine's plain decoding token for token, sampled and grammar-bound decoding likewise. The numbers
differ from llama.cpp's (another order of float operations), as any two engines' do.

What it runs: core/model/quantized/model.py (llama and qwen2 models; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and
Q6_K tensors); anything else is refused in one line naming the tensor and its type, and
`--backend auto` runs such a file on llama.cpp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...draft import Draft, check_draft
from ..prefix_cache import PrefixCache
from .attention import BLOCK
from .arch import FAMILIES
from .keys import key_layout
from .values import value_layout, value_move
from .model import Config, GGUFError, QuantModel
from .target import isa

__all__ = ["GGUFError", "KVCache", "QuantEngine", "QuantModel", "QuantPrefixCache", "QuantSession"]

PREFILL_CHUNK = 64  # prompt tokens per pass: the kernel's row chunk
# room a prefilled cache is made with past its prompt: an agent's answer and a draft tree's rows,
# so that a turn's cache is made once at its size, not grown (and copied) as it decodes
ANSWER_ROOM = 256


class KVCache:
    """One sequence's keys and values per layer, `length` entries used, in tiles of sixteen
    positions: keys [Hkv, C / 16, rows, 16] as config.keys says (core.model.quantized.keys.key_layout),
    values [Hkv, C / 16, rows, width] as config.values says (core.model.quantized.values.value_layout):
    by default int8 keys with their scales, and bfloat16 values where the CPU sums them (else
    float16); the buffers grow by a quarter (at least 256 positions) when full: at agents' context
    lengths a doubled cache would hold as much room as keys."""

    def __init__(self, config: Config, capacity: int = 256) -> None:
        self.config = config
        self.length = 0
        self.reused = 0  # entries copied from a prefix cache when it was made (the rest were prefilled)
        tiles = -(-capacity // 16)
        rows, dtype = key_layout(config.head_dim, config.keys)
        vrows, width, vtype = value_layout(config.head_dim, config.values)
        self.keys = [np.empty((config.kv_heads, tiles, rows, 16), dtype=dtype) for _ in range(config.layers)]
        # values zeroed: a tile's unwritten slots weigh 0 and must not be NaN (0 x NaN is NaN)
        self.values = [np.zeros((config.kv_heads, tiles, vrows, width), dtype=vtype) for _ in range(config.layers)]
        self._lists()

    def _lists(self) -> None:
        import numba

        self.key_list, self.value_list = numba.typed.List(self.keys), numba.typed.List(self.values)

    @staticmethod
    def bytes_per_token(config: Config) -> int:
        """What one position's keys and values take, over all layers."""
        rows, dtype = key_layout(config.head_dim, config.keys)
        vrows, width, vtype = value_layout(config.head_dim, config.values)
        per_tile = rows * 16 * np.dtype(dtype).itemsize + vrows * width * np.dtype(vtype).itemsize
        return config.layers * config.kv_heads * per_tile // 16

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] * 16

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        size = -(-max(n, self.capacity + max(self.capacity // 4, 256)) // 16) * 16
        tiles = -(-self.length // 16)
        for i in range(len(self.keys)):
            keys, values = (make((a.shape[0], size // 16, *a.shape[2:]), dtype=a.dtype)
                            for make, a in ((np.empty, self.keys[i]), (np.zeros, self.values[i])))
            keys[:, :tiles] = self.keys[i][:, :tiles]
            values[:, :tiles] = self.values[i][:, :tiles]
            self.keys[i], self.values[i] = keys, values
        self._lists()

    def keep(self, num_kept: int, moved: Sequence[int]) -> None:
        """Keep the first `num_kept` entries, then the entries `moved` (in order), drop the rest."""
        moved = [int(m) for m in moved]
        move_value = value_move(self.config.values)
        for i, src in enumerate(moved):  # each source lies after every earlier destination: nothing is overwritten early
            dst = num_kept + i
            if src != dst:
                for keys, values in zip(self.keys, self.values):
                    keys[:, dst // 16, :, dst % 16] = keys[:, src // 16, :, src % 16]
                    move_value(values, dst, src)
        self.length = num_kept + len(moved)

    def copy(self, n: int, capacity: int = 0) -> KVCache:
        """A new cache holding this one's first n entries, room for `capacity` (at least n)."""
        other = KVCache(self.config, max(n, capacity, 16))
        tiles = -(-n // 16)
        for i in range(len(self.keys)):
            other.keys[i][:, :tiles] = self.keys[i][:, :tiles]
            other.values[i][:, :tiles] = self.values[i][:, :tiles]
        other.length = n
        return other


def prefill(model: QuantModel, kv: KVCache, tokens: Sequence[int]) -> None:
    """Append `tokens` to `kv`, PREFILL_CHUNK at a time, each chunk causal."""
    for part in prefill_parts(kv, tokens):
        model.forward(*part)


def run_steps(steps: Generator[tuple[Any, ...], None, Any], run: Callable[[tuple[Any, ...]], Any]) -> Any:
    """Run each pass a steps generator (prefill_steps, start_steps) asks for with `run` (one
    QuantModel.forward, or a batched server's shared pass), before the next is asked for; what
    the generator returns."""
    try:
        part = next(steps)
        while True:
            run(part)
            part = next(steps)
    except StopIteration as done:
        return done.value


def prefill_parts(kv: KVCache, tokens: Sequence[int]) -> Iterator[tuple[Any, ...]]:
    """The passes that append `tokens` to `kv`, PREFILL_CHUNK at a time, each chunk causal, as
    QuantModel.forward_batch takes them: each is run before the next is made."""
    for start in range(0, len(tokens), PREFILL_CHUNK):
        chunk = list(tokens[start : start + PREFILL_CHUNK])
        n = len(chunk)
        positions = np.arange(kv.length, kv.length + n, dtype=np.int64)
        yield kv, chunk, positions, np.tril(np.ones((n, n), dtype=np.uint8)), np.array([n - 1])


def tree_layout(num_cached: int, num_pending: int, draft: Draft) -> tuple[np.ndarray, np.ndarray]:
    """(positions [Q], allowed [Q, Q]) of a pass over the pending tokens then the draft's nodes:
    pending tokens causal, each node sees the pending tokens and its ancestors (core/model/tree.py)."""
    depths = np.asarray(draft.depths(), dtype=np.int64)
    positions = np.concatenate([np.arange(num_pending), num_pending - 1 + depths]).astype(np.int64) + num_cached
    q = num_pending + len(draft)
    allowed = np.zeros((q, q), dtype=np.uint8)
    allowed[:, :num_pending] = np.tril(np.ones((q, num_pending), dtype=np.uint8))
    for i, parent in enumerate(draft.parents):
        row = num_pending + i
        if parent >= 0:
            allowed[row, num_pending:] = allowed[num_pending + parent, num_pending:]
        allowed[row, row] = 1
    return positions, allowed


class QuantPrefixCache(PrefixCache):
    """PrefixCache for the quantized engine (the GPU engine's too, core/model/gpu/engine.py's
    subclass: its model makes its caches, `fresh`). A stored prompt is the session's own KVCache,
    not a copy: a session changes no entry of its prompt (it appends, and keep_path moves accepted
    rows only past the prompt), so the first len(prompt) entries stay what the prefill wrote while
    the session decodes on, and a conversation's KV is held once, not twice. A later prompt that
    starts the same way gets a copy of them (its own cache, made at its prompt's size + ANSWER_ROOM)."""

    def prefill(self, model: Any, tokens: Sequence[int], cache: Any = None) -> KVCache:
        return run_steps(self.prefill_steps(model, tokens), lambda part: model.forward(*part))

    def fresh(self, model: Any, capacity: int = 256) -> Any:
        """An empty cache for `model`'s sequences, room for `capacity` entries."""
        return KVCache(model.config, capacity)

    def prefill_steps(self, model: Any, tokens: Sequence[int]) -> Generator[tuple[Any, ...], None, KVCache]:
        """`prefill` as the passes it needs (each run before the next is asked for; the batched
        server runs them beside other requests' passes); returns the KVCache."""
        started = time.perf_counter()
        tokens = [int(t) for t in tokens]
        usable = self.max_tokens > 0
        reuse, stored = self._claim(tokens, usable)
        room = len(tokens) + ANSWER_ROOM
        kv = stored.copy(reuse, room) if stored is not None else self.fresh(model, room)
        kv.reused = reuse
        self.seconds += time.perf_counter() - started
        yield from prefill_parts(kv, tokens[reuse:])
        started = time.perf_counter()
        self._keep(tokens, reuse, usable, kv)
        self.seconds += time.perf_counter() - started
        return kv

    def _store(self, tokens: list[int], cache: Any) -> None:
        self._add(tokens, cache)  # the session's cache itself (see the class): entries past len(tokens) are not read


class QuantSession:
    """One request's KVCache on the quantized engine: tree passes, the accepted path kept."""

    def __init__(self, model: QuantModel, kv: KVCache) -> None:
        self.model, self.kv = model, kv
        self._kept = 0  # entries before the draft's in the last pass: the cache + the pending tokens

    def score(self, pending: list[int], draft: Draft) -> Any:
        return score_batch([self], [pending], [draft])[0]

    @property
    def reused(self) -> int:
        """The cache's entries copied from a prefix cache when the session began (the rest were prefilled)."""
        return self.kv.reused

    def pass_for(self, pending: list[int], draft: Draft) -> tuple[Any, ...]:
        """This pass as core.model.quantized.model.QuantModel.forward_batch takes it (checked, bookkept):
        what a batcher runs beside other sessions' (core/serve/batch.py), then `keep_path` as after `score`."""
        check_draft(draft, self.model.config.vocab)
        if not pending:
            raise ValueError("verification needs at least one pending token (the root's logits come from it)")
        if self.kv.length + len(pending) + len(draft) > self.model.context_length:
            raise ValueError(f"the context of {self.model.context_length} tokens is full")
        self._kept = self.kv.length + len(pending)
        positions, allowed = tree_layout(self.kv.length, len(pending), draft)
        rows = np.arange(len(pending) - 1, len(pending) + len(draft))
        return self.kv, list(pending) + list(draft.token_ids), positions, allowed, rows

    def keep_path(self, accepted_nodes: list[int]) -> None:
        self.kv.keep(self._kept, [self._kept + n for n in accepted_nodes])


def score_batch(sessions: Sequence[QuantSession], pendings: Sequence[list[int]], drafts: Sequence[Draft]) -> list[Any]:
    """Each session's `score` (logits [1 + N, V]) in one forward pass over all their rows: every
    weight read once for the batch, each session attending to its own cache; a session's logits
    are the bits its own pass gives (batch-invariant kernels). The sessions must be distinct and
    of one model; each then keeps its path with `keep_path` as after `score`."""
    import torch

    if len({id(s) for s in sessions}) != len(sessions) or len({id(s.model) for s in sessions}) > 1:
        raise ValueError("a batch takes distinct sessions of one model")
    parts = [s.pass_for(p, d) for s, p, d in zip(sessions, pendings, drafts)]
    return [torch.from_numpy(logits) for logits in sessions[0].model.forward_batch(parts)]


class QuantEngine:
    """core.model.engine.Engine over a QuantModel."""

    name = "quantized"
    batches = True
    prompt_lookup = False
    tree_unsupported = None
    device = "cpu"
    prefix_cache_type = QuantPrefixCache

    def __init__(self, path: str | Path, context: int | None = None, say: Callable[[str], None] = lambda m: None,
                 keys: str = "q8", values: str | None = None) -> None:
        # the shape its passes' cost starts from: its kernels' family's (a row costs twice as much on AVX2 as on AVX-512)
        self.cost_curve = f"quantized-{isa() if isa() != 'generic' else 'avx2'}"
        self.model = QuantModel(path, context, say, keys, values)
        self.path = self.model.path
        self.vocab_size = self.model.config.vocab
        self.context_length = self.model.context_length
        self.precision = self.model.precision
        self.kv_bytes_per_token = KVCache.bytes_per_token(self.model.config)
        self.kernels = [f"quantized linear ({FAMILIES[isa()].NAME})",
                        f"attention in parts of {BLOCK} positions, {self.model.config.keys} keys, "
                        f"{self.model.config.values} values"]
        self.hit_tokens = 0
        started = time.perf_counter()
        say(f"quantized engine: {FAMILIES[isa()].NAME} kernels for this model (compiled once per CPU and formats, "
            "then read from numba's cache)")
        prefill(self.model, KVCache(self.model.config, 16), [0])  # compiles (or loads) every kernel the passes run
        self.compile_seconds = time.perf_counter() - started

    def start(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None) -> QuantSession:
        return run_steps(self.start_steps(tokens, prefix_cache), lambda part: self.model.forward(*part))

    def start_steps(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None
                    ) -> Generator[tuple[Any, ...], None, QuantSession]:
        """`start` as the prefill passes it needs (its prefix cache's prefill_steps); returns the session."""
        kind = self.prefix_cache_type
        prefixes = prefix_cache if isinstance(prefix_cache, kind) else kind(0)
        kv = yield from prefixes.prefill_steps(self.model, tokens)
        self.hit_tokens += kv.reused
        return QuantSession(self.model, kv)

    score_batch = staticmethod(score_batch)

    def new_prefix_cache(self, max_tokens: int) -> QuantPrefixCache:
        return self.prefix_cache_type(max_tokens)

    def clear(self) -> None:
        """Nothing is held between requests (the prefix caches are the callers')."""

    def thread_tuner(self, say: Callable[[str], None] = lambda message: None) -> Any:
        import numba

        from ..threads import ThreadTuner, set_threads

        threads = numba.get_num_threads()
        return ThreadTuner((threads, 1), set_threads, say) if threads > 1 else None

    def cost_key(self) -> dict[str, Any]:
        from importlib.metadata import version

        from ..llamacpp import file_digest

        return {"engine": self.name, "file": file_digest(self.path), "isa": isa(), "numba": version("numba")}

    def plain(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
              prefix_cache: PrefixCache | None = None, lookup: int | None = None) -> list[int]:
        """Greedy decoding one token per pass: the reference speculation on this engine equals."""
        if lookup:
            raise ValueError("prompt lookup runs on transformers; on the quantized engine: plain decoding and specx")
        session = self.start(list(prompt[:-1]), prefix_cache)
        empty = Draft([], [], [], 0.0, 0)
        pending, out = [int(prompt[-1])], []
        while len(out) < max_new_tokens:
            tok = int(session.score(pending, empty)[0].argmax())
            session.keep_path([])
            out.append(tok)
            if tok == eos_token_id:
                break
            pending = [tok]
        return out
