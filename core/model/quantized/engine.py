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

Here: the engine (QuantEngine: its model, kernels, threads and cost key), its KVCache (keys and
values in tiles of sixteen positions, int8 keys, bfloat16 values) and the prefix cache that makes
them (QuantPrefixCache). The sessions, their tree and prefill passes, the prefix cache's reuse,
batched passes and plain decoding are core/model/sessions.py's, shared with the GPU engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..sessions import SessionEngine, SessionPrefixCache
from .attention import BLOCK
from .arch import FAMILIES
from .keys import key_layout
from .values import value_layout, value_move
from .model import Config, GGUFError, QuantModel
from .target import isa

__all__ = ["GGUFError", "KVCache", "QuantEngine", "QuantModel", "QuantPrefixCache"]


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


class QuantPrefixCache(SessionPrefixCache):
    """SessionPrefixCache for the quantized engine: its caches are KVCaches (above)."""

    def fresh(self, model: QuantModel, capacity: int = 256) -> KVCache:
        return KVCache(model.config, capacity)


class QuantEngine(SessionEngine):
    """core.model.engine.Engine over a QuantModel (the sessions: core.model.sessions.SessionEngine)."""

    name = "quantized"
    device = "cpu"
    prefix_cache_type = QuantPrefixCache

    def __init__(self, path: str | Path, context: int | None = None, say: Callable[[str], None] = lambda m: None,
                 keys: str = "q8", values: str | None = None) -> None:
        # the shape its passes' cost starts from: its kernels' family's (a row costs twice as much on AVX2 as on AVX-512)
        self.cost_curve = f"quantized-{isa() if isa() != 'generic' else 'avx2'}"
        model = QuantModel(path, context, say, keys, values)
        self.precision = model.precision
        self.kv_bytes_per_token = KVCache.bytes_per_token(model.config)
        self.kernels = [f"quantized linear ({FAMILIES[isa()].NAME})",
                        f"attention in parts of {BLOCK} positions, {model.config.keys} keys, "
                        f"{model.config.values} values"]
        say(f"quantized engine: {FAMILIES[isa()].NAME} kernels for this model (compiled once per CPU and formats, "
            "then read from numba's cache)")
        super().__init__(model)

    def cost_key(self) -> dict[str, Any]:
        from importlib.metadata import version

        from ..llamacpp import file_digest

        return {"engine": self.name, "file": file_digest(self.path), "isa": isa(), "numba": version("numba")}
