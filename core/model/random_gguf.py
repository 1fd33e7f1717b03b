"""GGUF files of random weights in the llama layout (llama, or qwen2 with its q, k, v biases): for
tests and timing only, since such a model writes noise. The tests' tiny models of each tensor type
(`tiny_gguf`, which examples/gpu_check.py's dry run uses too) and the real model shapes
examples/model_ladder.py writes (`write_gguf` with its own weights and tokenizer) share the layout.
It lies outside quantized/, whose every file keys the kernels' numba cache (core/numba_cache.py).

    tiny_gguf(path, gguf.GGMLQuantizationType.Q4_K)   # 2 layers of width 256, random Q4_K blocks
    QuantEngine(path).plain([11, 22, 33], 8, None)    # 8 tokens of noise, the same every time
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .quantized.quant import TYPES

# the types gguf-py quantizes from float weights; other quantized types get blocks of random bits
ON_GGUF_PY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# (rows, width) -> (the tensor, its ggml type when it is raw blocks, else None)
Matrix = Callable[[int, int], "tuple[np.ndarray, Any]"]


@dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF states it (the defaults: the tests' tiny model)."""

    layers: int = 2
    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 49152
    context: int = 1024
    rope_base: float = 10000.0
    tied: bool = True  # the output layer is the token embedding (no output.weight)


def ones(size: int) -> np.ndarray:
    return np.ones(size, dtype=np.float32)


def write_gguf(path: Path, shape: Shape, matrix: Matrix, *, arch: str = "llama", norm: Callable = ones,
               bias: Callable | None = None, metadata: Callable | None = None,
               on_layer: Callable[[int], None] | None = None) -> Path:
    """Write a GGUF of `shape` at `path`: each 2-D weight from `matrix(rows, width)`, each norm's
    weights from `norm(size)` (the output norm's: ones), qwen2's biases from `bias(size)`, in the
    order of llama.cpp's converter (the embedding; per layer its norms, q, k, v, the biases, the
    attention output, gate, up, down; the output norm; the output layer when not tied).
    `metadata(writer)` adds keys (a tokenizer, a name); `on_layer(i)` is told of each layer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    if metadata is not None:
        metadata(writer)

    def add(name: str, rows: int, width: int) -> None:
        data, raw_dtype = matrix(rows, width)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)

    hidden, ffn, head_dim = shape.hidden, shape.ffn, shape.hidden // shape.heads
    q_rows, kv_rows = shape.heads * head_dim, shape.kv_heads * head_dim
    add("token_embd.weight", shape.vocab, hidden)
    for i in range(shape.layers):
        if on_layer is not None:
            on_layer(i)
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm(hidden))
        writer.add_tensor(p + "ffn_norm.weight", norm(hidden))
        add(p + "attn_q.weight", q_rows, hidden)
        add(p + "attn_k.weight", kv_rows, hidden)
        add(p + "attn_v.weight", kv_rows, hidden)
        if arch == "qwen2":
            for n, size in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                writer.add_tensor(p + f"attn_{n}.bias", bias(size))
        add(p + "attn_output.weight", hidden, q_rows)
        add(p + "ffn_gate.weight", ffn, hidden)
        add(p + "ffn_up.weight", ffn, hidden)
        add(p + "ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", ones(hidden))
    if not shape.tied:
        add("output.weight", shape.vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, width: int) -> np.ndarray:
    """Raw rows of random blocks of `qtype` (a quantized type of quant.TYPES): random bits, with
    sane float16 scales and mins."""
    name, size, per = TYPES[int(qtype)]
    raw = rng.integers(0, 256, size=(rows, width // per, size), dtype=np.uint8)
    f16 = lambda: rng.uniform(-0.05, 0.05, size=(rows, width // per)).astype(np.float16).view(np.uint8).reshape(
        rows, width // per, 2)  # noqa: E731
    if name == "Q6_K":
        raw[..., 208:210] = f16()
    else:
        raw[..., 0:2] = f16()
        if name in ("Q4_1", "Q5_1", "Q4_K"):
            raw[..., 2:4] = f16()
    return raw.reshape(rows, -1)


def tiny_gguf(path: Path, qtype: Any, *, hidden: int = 256, ffn: int = 512, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, vocab: int = 49152, seed: int = 0, arch: str = "llama", context: int = 1024) -> Path:
    """A tiny random GGUF model (`arch`) with 2-D weights of `qtype` (a gguf.GGMLQuantizationType:
    F32, F16, a type gguf-py quantizes, or random blocks of a K-quant), normal with std 0.5 before
    quantizing; norms uniform in [0.5, 1.5]; the output layer tied."""
    import gguf

    qtype = gguf.GGMLQuantizationType(qtype)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, width: int) -> tuple[np.ndarray, Any]:
        if qtype.name not in ("F32", "F16", *ON_GGUF_PY):
            return random_blocks(rng, qtype, rows, width), qtype
        w = rng.standard_normal((rows, width)).astype(np.float32) * np.float32(0.5)
        if qtype.name in ON_GGUF_PY:
            return gguf.quants.quantize(w, qtype), qtype
        return (w if qtype.name == "F32" else w.astype(np.float16)), None

    shape = Shape(layers, hidden, ffn, heads, kv_heads, vocab, context)
    return write_gguf(path, shape, matrix, arch=arch, norm=lambda size: rng.uniform(0.5, 1.5, size).astype(np.float32),
                      bias=lambda size: rng.standard_normal(size).astype(np.float32))
