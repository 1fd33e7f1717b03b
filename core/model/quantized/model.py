"""A GGUF model for the quantized engine (core/model/quantized/engine.py): its configuration, its weights
packed as the file holds them (core/model/quantized/quant.py: never de-quantized), and the forward pass.

    model = QuantModel("model.Q4_K_M.gguf")
    logits = model.forward(kv, tokens, positions, allowed, logits_rows)   # qengine drives it

Architectures: llama (Llama 2/3, SmolLM, Mistral without sliding windows) and qwen2. Tensor
types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K (Q4_K_M files mix Q4_K and Q6_K, and fall back
to Q5_0/Q8_0 where a row is not a multiple of 256), F32 norms and biases. Anything else is refused
in one line naming the tensor and its type (`unsupported` says it without loading the weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import forward as qforward
from .attention import attention
from .keys import check_keys, key_store
from .values import check_values, default_values, value_store
from .kernel import Inputs, any_driver, qmatmul
from .quant import (FLOAT_TYPES, FORMATS, PANEL, TYPES, Packed, UnsupportedType, concat, dequantize, pack_tensor,
                    type_name, unpack, unpack_rows)

ARCHITECTURES = ("llama", "qwen2")
WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def unsupported(path: str | Path) -> str | None:
    """Why the quantized engine cannot run the GGUF at `path` (its architecture, a tensor's type,
    a damaged header), in one line; None when it can. Reads the header only (fast)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        read_config(reader)
    except GGUFError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - gguf-py raises anything on a damaged file
        return f"not a readable GGUF file ({type(exc).__name__})"
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if t.name.rsplit(".", 2)[-2] in WEIGHTS or t.name in ("token_embd.weight", "output.weight"):
            if qtype not in TYPES:
                return f"tensor {t.name} is {type_name(qtype)}, which the quantized engine does not run"
    return None


class GGUFError(ValueError):
    """A GGUF file this engine cannot run: damaged, or holding what it does not support."""


@dataclass
class Config:
    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    eps: float
    context: int
    vocab: int
    keys: str = "q8"  # how the cache keeps keys (core.model.quantized.keys.KEYS)
    values: str = "f16"  # and values (core.model.quantized.values.FORMATS)


@dataclass
class Layer:
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    qkv: list[Packed]  # one fused matrix when q, k and v share a type, else three
    bias: np.ndarray | None  # q, k, v biases (qwen2), [q + k + v]
    out: Packed
    gate_up: list[Packed]
    down: Packed

    @property
    def groups(self) -> list[list[Packed]]:
        """The matrices in the order a pass runs them, those read from one input together."""
        return [self.qkv, [self.out], self.gate_up, [self.down]]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise GGUFError(f"it has no {key!r}")
        return default
    return field.contents()


def read_config(reader: Any) -> Config:
    arch = str(_field(reader, "general.architecture"))
    if arch not in ARCHITECTURES:
        raise GGUFError(f"the quantized engine runs {', '.join(ARCHITECTURES)} models; this one is {arch!r}")
    get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if head_dim % 16 or heads % kv_heads or heads * head_dim % 32:
        raise GGUFError(f"heads of {head_dim} (a multiple of 16 runs) and {heads} query heads over {kv_heads} "
                        f"key/value heads: the quantized engine does not run this shape")
    if get("attention.sliding_window", 0):
        raise GGUFError("sliding-window attention is not supported by the quantized engine")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError("it has no token_embd.weight")
    vocab = int(get("vocab_size", len(tokens.data) if tokens is not None else int(embd.shape[1])))
    return Config(arch, int(get("block_count")), hidden, int(get("feed_forward_length")), heads, kv_heads,
                  head_dim, int(get("rope.dimension_count", head_dim)), float(get("rope.freq_base", 10000.0)),
                  float(get("attention.layer_norm_rms_epsilon", 1e-5)), int(get("context_length", 4096)), vocab)


class QuantModel:
    """A GGUF model's weights, packed, and its forward pass (`forward`)."""

    def __init__(self, path: str | Path, context: int | None = None, say: Callable[[str], None] = lambda m: None,
                 keys: str = "q8", values: str | None = None) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"no such GGUF file: {self.path}")
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # noqa: BLE001 - gguf-py raises anything on a damaged file
            raise GGUFError(f"{self.path} is not a readable GGUF file ({type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'damaged'})") from None
        tensors = {t.name: t for t in reader.tensors}
        self.types: dict[str, int] = {}

        def raw(name: str, rows: int, width: int) -> tuple[np.ndarray, int]:
            t = tensors.get(name)
            if t is None:
                raise GGUFError(f"it has no tensor {name!r}")
            qtype = int(t.tensor_type)
            if [int(d) for d in t.shape] != [width, rows]:
                raise GGUFError(f"tensor {name} has shape {list(t.shape)}, not [{width}, {rows}]")
            if qtype not in TYPES:
                raise UnsupportedType(f"tensor {name} is {type_name(qtype)}, which the quantized engine does not run")
            name_, size, per = TYPES[qtype]
            data = np.asarray(t.data)
            if data.size != rows * (width // per) * size:
                raise GGUFError(f"tensor {name} holds {data.size} bytes of the {rows * (width // per) * size} "
                                f"its type and shape need (a truncated file?)")
            self.types[name_] = self.types.get(name_, 0) + rows * width
            return data.reshape(rows, -1), qtype

        def weight(name: str, rows: int, width: int) -> Packed:
            data, qtype = raw(name, rows, width)
            return pack_tensor(data, qtype, width)

        def vector(name: str, size: int, required: bool = True) -> np.ndarray | None:
            t = tensors.get(name)
            if t is None:
                if required:
                    raise GGUFError(f"it has no tensor {name!r}")
                return None
            if int(t.tensor_type) not in FLOAT_TYPES or int(t.n_elements) != size:
                raise GGUFError(f"tensor {name} is {type_name(int(t.tensor_type))} of {int(t.n_elements)} values, "
                                f"not {size} floats")
            return np.array(t.data, dtype=np.float32).reshape(size)

        try:
            cfg = read_config(reader)
            check_keys(keys)
            # int8 keys are quantized per 32 dimensions: other head sizes keep float16 keys
            self.config = cfg = replace(cfg, keys=keys if cfg.head_dim % 32 == 0 else "f16",
                                        values=check_values(values or default_values()))
            self.context_length = min(context or cfg.context, cfg.context)  # default: the model's own
            h, kvw, qw = cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg.heads * cfg.head_dim
            self.layers = []
            for i in range(cfg.layers):
                say(f"packing layer {i + 1}/{cfg.layers}")
                p = f"blk.{i}."
                q, k, v = (weight(p + "attn_q.weight", qw, h), weight(p + "attn_k.weight", kvw, h),
                           weight(p + "attn_v.weight", kvw, h))
                biases = [vector(p + f"attn_{n}.bias", size, required=False) for n, size in (("q", qw), ("k", kvw), ("v", kvw))]
                bias = np.concatenate(biases) if all(b is not None for b in biases) else None
                gate, up = weight(p + "ffn_gate.weight", cfg.ffn, h), weight(p + "ffn_up.weight", cfg.ffn, h)
                self.layers.append(Layer(vector(p + "attn_norm.weight", h), vector(p + "ffn_norm.weight", h),
                                         _stack([q, k, v]), bias, weight(p + "attn_output.weight", h, qw),
                                         _stack([gate, up]), weight(p + "ffn_down.weight", h, cfg.ffn)))
            self.out_norm = vector("output_norm.weight", h)
            embed_raw, self.embed_type = raw("token_embd.weight", cfg.vocab, h)
            if "output.weight" in tensors:
                self.output = weight("output.weight", cfg.vocab, h)
                self.embed_raw = np.array(embed_raw)  # out of the file's mapping, which then closes
            else:  # tied: lookups read the packed output layer (core.model.quantized.quant.unpack_rows), one copy
                self.output = pack_tensor(embed_raw, self.embed_type, h)
                self.embed_raw = None
            freqs = vector("rope_freqs.weight", cfg.rope_dim // 2, required=False)
        except UnsupportedType as exc:
            raise UnsupportedType(f"{self.path.name}: {exc}") from None
        except (ValueError, IndexError) as exc:
            raise GGUFError(f"{self.path.name}: {exc}") from None
        del reader, tensors
        _release_freed_memory()
        self.cos, self.sin = rope_tables(cfg, self.context_length, freqs)
        self.scale = np.float32(1.0 / math.sqrt(cfg.head_dim))
        matrices = [w for layer in self.layers for group in layer.groups for w in group] + [self.output]
        self.weight_bytes = sum(w.nbytes for w in matrices)
        self.multiply_adds = sum(w.n * w.k for w in matrices)
        self._layers: Any = None

    def _compile(self) -> None:
        """The layers as one compiled call (core.model.quantized.forward.build_layers) over the formats this
        file holds, and their weights as it reads them."""
        import numba

        cfg = self.config
        groups_of = [layer.groups for layer in self.layers]
        formats = tuple(dict.fromkeys(w.fmt for groups in groups_of for group in groups for w in group))
        self._mats = numba.typed.List()
        self._groups = np.zeros((cfg.layers, 4, 2), dtype=np.int64)
        for i, groups in enumerate(groups_of):
            for g, group in enumerate(groups):
                self._groups[i, g, 0] = len(self._mats)
                for w in group:
                    self._mats.append((*w.arrays, np.int64(formats.index(w.fmt)), np.int64(w.n)))
                self._groups[i, g, 1] = len(self._mats)
        self._norms = np.stack([np.stack([layer.attn_norm, layer.ffn_norm]) for layer in self.layers])
        width = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
        self._has_bias = any(layer.bias is not None for layer in self.layers)
        self._biases = np.stack([layer.bias if layer.bias is not None else np.zeros(width, dtype=np.float32)
                                 for layer in self.layers]).astype(np.float32)
        attend = attention(cfg.heads // cfg.kv_heads, cfg.head_dim, keys=cfg.keys, values=cfg.values)
        self._layers = qforward.build_layers(any_driver(formats), attend, key_store(cfg.keys), value_store(cfg.values))

    @property
    def precision(self) -> str:
        """The tensor types by share of the weights, e.g. "Q4_K 82%, Q6_K 18%"."""
        total = sum(self.types.values())
        return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in
                         sorted(self.types.items(), key=lambda kv: -kv[1]))

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.config.vocab):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab})")
        if self.embed_raw is None:
            q, s, m = unpack_rows(self.output, ids)
        else:
            q, s, m = unpack(self.embed_raw[ids], self.embed_type, self.config.hidden)
        return dequantize(q, s, m, FORMATS[TYPES[self.embed_type][0]])

    def forward(self, kv: Any, tokens: Sequence[int], positions: np.ndarray, allowed: np.ndarray,
                logits_rows: np.ndarray) -> np.ndarray:
        """Run `tokens` (at `positions`, each seeing the cache and the new tokens `allowed` [S, S]
        marks) through the model, appending their keys and values to `kv` (a
        core.model.quantized.engine.KVCache); the logits [R, V] of the rows `logits_rows`."""
        return self.forward_batch([(kv, tokens, positions, allowed, logits_rows)])[0]

    def forward_batch(self, parts: Sequence[tuple[Any, Sequence[int], np.ndarray, np.ndarray, np.ndarray]]
                      ) -> list[np.ndarray]:
        """`forward` for several sequences in one pass, each part (kv, tokens, positions, allowed,
        logits_rows) as there: the linear layers read each weight once for all their rows, each
        sequence attends to its own cache. Every row's logits are the bits `forward` gives it
        alone (the kernels are batch-invariant)."""
        import numba

        cfg = self.config
        if self._layers is None:
            self._compile()
        starts = np.zeros(len(parts) + 1, dtype=np.int64)
        for i, (_, tokens, _, _, _) in enumerate(parts):
            starts[i + 1] = starts[i] + len(tokens)
        x = self.embed([int(t) for part in parts for t in part[1]])  # [S, E]
        n0s = np.array([kv.length for kv, *_ in parts], dtype=np.int64)
        keys, values, alloweds = numba.typed.List(), numba.typed.List(), numba.typed.List()
        for (kv, tokens, _, allowed, _), n0 in zip(parts, n0s):
            kv.reserve(int(n0) + len(tokens))
            keys.append(kv.key_list)
            values.append(kv.value_list)
            alloweds.append(np.ascontiguousarray(allowed, dtype=np.uint8))
        positions = np.concatenate([np.asarray(p[2], dtype=np.int64) for p in parts])
        x = self._layers(x, positions, starts, alloweds, n0s, self._mats, self._groups, self._norms, self._biases,
                         self._has_bias, keys, values, self.cos, self.sin, cfg.arch == "qwen2", cfg.eps, self.scale,
                         cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn)
        for (kv, tokens, *_), n0 in zip(parts, n0s):
            kv.length = int(n0) + len(tokens)
        rows = np.concatenate([np.asarray(p[4], dtype=np.int64) + starts[i] for i, p in enumerate(parts)])
        last = np.ascontiguousarray(x[rows])
        out = np.empty_like(last)
        qforward.rms_norm(last, self.out_norm, cfg.eps, out)
        logits = qmatmul(Inputs(out), self.output)[:, : cfg.vocab]
        bounds = np.cumsum([0] + [len(p[4]) for p in parts])
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(parts))]


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc keeps the packing's freed buffers
    otherwise: ~0.4 GB of resident memory for a 3B model); a no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _stack(parts: list[Packed]) -> list[Packed]:
    """One matrix for weights read from the same input when they share a type (one kernel call)."""
    if all(p.qtype == parts[0].qtype for p in parts) and all(p.n % PANEL == 0 for p in parts[:-1]):
        return [concat(parts)]
    return parts


def rope_tables(cfg: Config, positions: int, freqs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [P, R/2] of every position's angles (float64, then float32): fixed at load, so a
    position's rotation never depends on the pass it is in. Llama 3's rope_freqs divide the frequencies."""
    half = cfg.rope_dim // 2
    inv = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2 / cfg.rope_dim)
    if freqs is not None:
        inv = inv / freqs.astype(np.float64)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


