"""A GGUF model in bfloat16 on a GPU, for the GPU engine (core/model/gpu/engine.py): its weights
de-quantized once (gguf-py) and kept in bfloat16 on the device, the KV caches of every request in
one paged pool, and the forward pass over several requests' rows (core/model/gpu/kernels.py).

    model = GPUModel("model.Q4_K_M.gguf", device="cuda")
    logits = model.forward(kv, tokens, positions, allowed, logits_rows)   # the engine drives it

Architectures as core/model/quantized/model.py reads them (llama, qwen2; its `read_config`); any
tensor type gguf-py de-quantizes. Numbers: weights, matmul inputs and cached keys and values in
bfloat16; the residual stream, norms, accumulations, attention and logits in float32.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..quantized.model import Config, GGUFError, read_config, rope_tables

PAGE = 16  # KV slots per page of the pool


class KVPool:
    """Every request's keys and values, one pool per model: keys and values [L, pages x PAGE,
    kv_heads, head_dim] bfloat16; a request's cache (KVCache) holds a list of its pages. The pool
    doubles when it runs out (pages keep their numbers), so one pass reads all requests' caches."""

    def __init__(self, config: Config, device: torch.device, pages: int = 64) -> None:
        self.config, self.device = config, device
        shape = (config.layers, pages * PAGE, config.kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.values = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.free = list(range(pages - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        while len(self.free) < n:
            self._grow()
        return [self.free.pop() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)

    def _grow(self) -> None:
        old = self.keys.shape[1] // PAGE
        for name in ("keys", "values"):
            t = getattr(self, name)
            bigger = torch.zeros((t.shape[0], 2 * t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
            bigger[:, : t.shape[1]] = t
            setattr(self, name, bigger)
        self.free.extend(range(2 * old - 1, old - 1, -1))


class KVCache:
    """One sequence's entries in the pool: slot s is row pages[s // PAGE] * PAGE + s % PAGE of
    it; `length` slots used; the pages go back to the pool when the cache is dropped."""

    def __init__(self, pool: KVPool) -> None:
        self.pool, self.length, self.reused = pool, 0, 0
        self.pages: list[int] = []
        weakref.finalize(self, pool.give, self.pages)  # the same list object, however it grows

    @staticmethod
    def bytes_per_token(config: Config) -> int:
        return config.layers * 2 * config.kv_heads * config.head_dim * 2

    @property
    def capacity(self) -> int:
        return len(self.pages) * PAGE

    def reserve(self, n: int) -> None:
        if n > self.capacity:
            self.pages.extend(self.pool.take(-(-n // PAGE) - len(self.pages)))

    def rows(self, slots: Any) -> np.ndarray:
        """The pool rows of these slots."""
        slots = np.asarray(slots, dtype=np.int64)
        return np.asarray(self.pages, dtype=np.int64)[slots // PAGE] * PAGE + slots % PAGE

    def keep(self, num_kept: int, moved: Sequence[int]) -> None:
        """Keep the first `num_kept` entries, then the entries `moved` (in order), drop the rest."""
        moved = [int(m) for m in moved]
        dst = list(range(num_kept, num_kept + len(moved)))
        if moved != dst:
            self._copy(self, self.rows(moved), self.rows(dst))
        self.length = num_kept + len(moved)

    def copy(self, n: int, capacity: int = 0) -> KVCache:
        """A new cache holding this one's first n entries (pages of its own), room for `capacity`."""
        other = KVCache(self.pool)
        other.reserve(max(n, capacity, 1))
        if n:
            self._copy(other, self.rows(np.arange(n)), other.rows(np.arange(n)))
        other.length = n
        return other

    def _copy(self, target: KVCache, src: np.ndarray, dst: np.ndarray) -> None:
        pool = self.pool
        src_t, dst_t = (torch.as_tensor(a, device=pool.device) for a in (src, dst))
        pool.keys[:, dst_t] = pool.keys[:, src_t]  # the right side is gathered first: overlaps are safe
        pool.values[:, dst_t] = pool.values[:, src_t]


class GPUModel:
    """A GGUF model's weights in bfloat16 on `device`, its KV pool, and its forward pass."""

    def __init__(self, path: str | Path, context: int | None = None, device: str | torch.device | None = None,
                 say: Callable[[str], None] = lambda m: None) -> None:
        import gguf

        from . import kernels

        self.kernels = kernels
        self.path = Path(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tensor_cores = self.device.type == "cuda"  # the interpreter has no bfloat16 products (kernels.py)
        if not self.path.is_file():
            raise GGUFError(f"no such GGUF file: {self.path}")
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # noqa: BLE001 - gguf-py raises anything on a damaged file
            raise GGUFError(f"{self.path} is not a readable GGUF file ({type(exc).__name__})") from None
        tensors = {t.name: t for t in reader.tensors}
        self.config = cfg = read_config(reader)
        self.context_length = min(context or cfg.context, cfg.context)  # default: the model's own

        def floats(name: str, size: int | None = None) -> np.ndarray | None:
            t = tensors.get(name)
            if t is None:
                return None
            try:
                values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            except NotImplementedError:
                raise GGUFError(f"{self.path.name}: gguf-py cannot de-quantize tensor {name} "
                                f"({t.tensor_type.name})") from None
            if size is not None and values.size != size:
                raise GGUFError(f"{self.path.name}: tensor {name} holds {values.size} values, not {size}")
            return values

        def matrix(*names: str, rows: Sequence[int], width: int) -> torch.Tensor:
            parts = []
            for name, n in zip(names, rows):
                values = floats(name, n * width)
                if values is None:
                    raise GGUFError(f"{self.path.name}: it has no tensor {name!r}")
                values = values if values.flags.writeable else values.copy()  # an F32 tensor is the file's mapping
                parts.append(torch.from_numpy(values.reshape(n, width)).to(self.device, torch.bfloat16))
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        def vector(name: str, size: int) -> torch.Tensor | None:
            values = floats(name, size)
            return None if values is None else torch.from_numpy(values.astype(np.float32)).to(self.device)

        h, ffn, qw, kvw = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.layers = []
        for i in range(cfg.layers):
            say(f"loading layer {i + 1}/{cfg.layers} in bfloat16")
            p = f"blk.{i}."
            biases = [vector(p + f"attn_{n}.bias", size) for n, size in (("q", qw), ("k", kvw), ("v", kvw))]
            norms = [vector(p + n, h) for n in ("attn_norm.weight", "ffn_norm.weight")]
            if any(n is None for n in norms):
                raise GGUFError(f"{self.path.name}: layer {i} has no attention or feed-forward norm")
            self.layers.append({
                "attn_norm": norms[0], "ffn_norm": norms[1],
                "qkv": matrix(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight", rows=(qw, kvw, kvw),
                              width=h),
                "bias": torch.cat(biases) if all(b is not None for b in biases) else None,
                "out": matrix(p + "attn_output.weight", rows=(h,), width=qw),
                "gate_up": matrix(p + "ffn_gate.weight", p + "ffn_up.weight", rows=(ffn, ffn), width=h),
                "down": matrix(p + "ffn_down.weight", rows=(h,), width=ffn)})
        self.embedding = matrix("token_embd.weight", rows=(cfg.vocab,), width=h)
        self.output = (matrix("output.weight", rows=(cfg.vocab,), width=h) if "output.weight" in tensors
                       else self.embedding)  # tied
        self.out_norm = vector("output_norm.weight", h)
        if self.out_norm is None:
            raise GGUFError(f"{self.path.name}: it has no tensor 'output_norm.weight'")
        freqs = floats("rope_freqs.weight", cfg.rope_dim // 2)
        cos, sin = rope_tables(cfg, self.context_length, freqs)
        self.cos, self.sin = torch.from_numpy(cos).to(self.device), torch.from_numpy(sin).to(self.device)
        del reader, tensors
        self.pool = KVPool(cfg, self.device)
        matrices = [w for layer in self.layers for w in (layer["qkv"], layer["out"], layer["gate_up"], layer["down"])]
        self.weight_bytes = sum(w.numel() * 2 for w in matrices + [self.output])  # what a pass reads (`specx bench cost`)
        self.multiply_adds = sum(w.numel() for w in matrices + [self.output])

    def new_cache(self) -> KVCache:
        return KVCache(self.pool)

    def forward(self, kv: KVCache, tokens: Sequence[int], positions: np.ndarray, allowed: np.ndarray,
                logits_rows: np.ndarray) -> np.ndarray:
        """Run `tokens` (at `positions`, each seeing the cache and the new tokens `allowed` [S, S]
        marks) through the model, appending their keys and values to `kv`; the logits [R, V]
        (float32, on the host) of the rows `logits_rows`."""
        return self.forward_batch([(kv, tokens, positions, allowed, logits_rows)])[0]

    def forward_batch(self, parts: Sequence[tuple[KVCache, Sequence[int], np.ndarray, np.ndarray, np.ndarray]]
                      ) -> list[np.ndarray]:
        """`forward` for several sequences in one pass (as QuantModel.forward_batch): every matmul
        reads its weights once for all rows, each row attends to its own sequence only, and every
        row's logits are the bits `forward` gives it alone (core/model/gpu/kernels.py)."""
        cfg, k = self.config, self.kernels
        ids = [int(t) for part in parts for t in part[1]]
        if ids and (min(ids) < 0 or max(ids) >= cfg.vocab):
            raise ValueError(f"token ids must lie in [0, {cfg.vocab})")
        for kv, tokens, *_ in parts:
            kv.reserve(kv.length + len(tokens))
        plan = self._plan(parts)
        qw, kvw, hd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.head_dim
        x = self.embedding[torch.as_tensor(ids, device=self.device)].float()  # [S, E]
        delta = None
        for i, layer in enumerate(self.layers):
            h = k.rms_norm(x, layer["attn_norm"], cfg.eps, delta)
            qkv = k.matmul(h, layer["qkv"], layer["bias"], tensor_cores=self.tensor_cores)  # [S, qw + 2 kvw]
            k.rope(qkv, cfg.heads + cfg.kv_heads, hd, plan["positions"], self.cos, self.sin, cfg.arch == "qwen2")
            self.pool.keys[i, plan["write"]] = qkv[:, qw : qw + kvw].reshape(-1, cfg.kv_heads, hd).to(torch.bfloat16)
            self.pool.values[i, plan["write"]] = qkv[:, qw + kvw :].reshape(-1, cfg.kv_heads, hd).to(torch.bfloat16)
            att = k.attention(qkv, self.pool.keys[i], self.pool.values[i], plan["pages"], plan["meta"], plan["cols"],
                              cfg.heads, cfg.kv_heads, hd, PAGE)
            h = k.rms_norm(x, layer["ffn_norm"], cfg.eps, k.matmul(att, layer["out"], tensor_cores=self.tensor_cores))
            delta = k.matmul(k.silu_mul(k.matmul(h, layer["gate_up"], tensor_cores=self.tensor_cores)), layer["down"],
                             tensor_cores=self.tensor_cores)
        for kv, tokens, *_ in parts:
            kv.length += len(tokens)
        last = x[plan["logits_rows"]] + delta[plan["logits_rows"]]
        logits = k.matmul(k.rms_norm(last, self.out_norm, cfg.eps), self.output, tensor_cores=self.tensor_cores)
        logits = logits.cpu().numpy()
        bounds = np.cumsum([0] + [len(p[4]) for p in parts])
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(parts))]

    def _plan(self, parts: Sequence[tuple[Any, ...]]) -> dict[str, torch.Tensor]:
        """A pass's row bookkeeping, built on the host and sent in one copy: each row's position,
        the pool rows its key and value go to, the sequences' page tables, each row's attention
        span (kernels.attention's meta) and visible columns, and the rows whose logits are wanted."""
        positions, write, pages, meta, cols, wanted = [], [], [], [], [], []
        start = table = col = 0  # rows, page-table entries and visible columns so far
        for kv, tokens, pos, allowed, logits_rows in parts:
            n = len(tokens)
            pages.append(np.asarray(kv.pages, dtype=np.int64))
            positions.append(np.asarray(pos, dtype=np.int64))
            write.append(kv.rows(np.arange(kv.length, kv.length + n)))
            allowed = np.asarray(allowed, dtype=bool).reshape(n, n)
            for r in range(n):
                visible = np.flatnonzero(allowed[r])
                meta.append((table, kv.length, kv.length + len(visible), col))
                cols.append(visible)
                col += len(visible)
            wanted.append(np.asarray(logits_rows, dtype=np.int64) + start)
            start += n
            table += len(kv.pages)
        flat = [np.concatenate(a) if a else np.zeros(0, dtype=np.int64)
                for a in (positions, write, pages, cols, wanted)]
        flat.insert(4, np.asarray(meta, dtype=np.int64).reshape(-1))
        sizes = np.cumsum([0] + [len(a) for a in flat])
        both = torch.as_tensor(np.concatenate(flat).astype(np.int32)).to(self.device)
        names = ("positions", "write", "pages", "cols", "meta", "logits_rows")
        plan = {name: both[sizes[j] : sizes[j + 1]] for j, name in enumerate(names)}
        plan["meta"] = plan["meta"].view(-1, 4)
        plan["write"], plan["logits_rows"] = plan["write"].long(), plan["logits_rows"].long()
        return plan
