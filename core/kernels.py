"""A faster forward pass for small verification batches on CPU, the same for every decoding method.

A decode step on CPU reads every weight once and does little arithmetic with it, so it should
cost about the same for 1 token as for 8. With stock PyTorch it does not: verifying 8 tokens costs
~2x one token. Three things cause it, and `accelerate(model)` fixes each in place:

- **Linear layers.** MKL's sgemm runs 1-3 rows as a matrix-vector product but from 4 rows on
  packs the weight matrix into a scratch buffer first, which on a model that does not fit in
  cache triples the memory traffic. `small_matmul` streams each weight row once and forms all the
  rows' dot products from it, so 4-24 rows cost little more than one. Within that range it is
  batch-invariant: a row's result is the same bits whatever the other rows are and however many
  (each dot product is reduced in one fixed order). One to three rows (plain decoding) and larger
  inputs (prefill) stay on MKL, as in stock PyTorch.
- **Grouped-query attention with a mask.** transformers copies the key/value heads once per query
  head (`repeat_kv`) whenever a mask is passed, i.e. on every tree verification. `gqa_attention`
  instead folds the query heads that share a key/value head into extra query rows, the way
  transformers already does for a single query token.
- **The KV cache.** `DynamicCache` appends with `torch.cat`, copying the whole cache every step.
  `GrowingCache` writes new entries into a buffer that doubles when full.

The model object is changed in place, so transformers' own `generate` (the plain and prompt-lookup
baselines) runs on the same kernels as specx.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# Rows that go through small_matmul (measured on the built-in model, linear layers alone): below 4
# MKL runs a matrix-vector product that is as fast and plain decoding keeps it; above 24 MKL's
# blocked GEMM wins.
MIN_ROWS, MAX_ROWS = 4, 24
ATTENTION = "specx_sdpa"


@intrinsic
def _prefetch(typingctx, arr, index):  # pragma: no cover - compiled
    """Ask the CPU to start loading the cache line of arr.flat[index] (LLVM's prefetch intrinsic:
    read, keep in all cache levels); no result, no fault on any address."""

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
            ir.VoidType(), [byte_ptr, i32, i32, i32]))
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), byte_ptr),
                          ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def small_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """out[m, j] = dot(x[m], w[j]) for x [M, K] with M a multiple of 4, w [N, K] (a Linear's weight),
    out [M, N].

    Four weight rows at a time are prefetched into cache and dotted with every group of four input
    rows: the weights are read from memory once whatever M is, and each load feeds four FMAs.
    Every dot product is its own accumulator over k, a reduction that fastmath lets LLVM
    vectorize; its order depends on K only, never on M, on the other rows or on a row's place in
    its group.
    """
    rows, k_dim = x.shape
    n = w.shape[0]
    n4 = n // 4
    flat = w.reshape(-1)
    for b in prange((n4 + 7) // 8):  # blocks of 32 output columns, split between the threads
        for q in range(b * 8, min(n4, b * 8 + 8)):
            j = 4 * q
            for line in range(j * k_dim, (j + 4) * k_dim, 16):  # 16 floats: one 64-byte cache line
                _prefetch(flat, line)
            for m in range(0, rows, 4):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                b0 = np.float32(0.0)
                b1 = np.float32(0.0)
                b2 = np.float32(0.0)
                b3 = np.float32(0.0)
                c0 = np.float32(0.0)
                c1 = np.float32(0.0)
                c2 = np.float32(0.0)
                c3 = np.float32(0.0)
                d0 = np.float32(0.0)
                d1 = np.float32(0.0)
                d2 = np.float32(0.0)
                d3 = np.float32(0.0)
                for k in range(k_dim):
                    xa = x[m, k]
                    xb = x[m + 1, k]
                    xc = x[m + 2, k]
                    xd = x[m + 3, k]
                    w0 = w[j, k]
                    w1 = w[j + 1, k]
                    w2 = w[j + 2, k]
                    w3 = w[j + 3, k]
                    a0 += w0 * xa
                    a1 += w1 * xa
                    a2 += w2 * xa
                    a3 += w3 * xa
                    b0 += w0 * xb
                    b1 += w1 * xb
                    b2 += w2 * xb
                    b3 += w3 * xb
                    c0 += w0 * xc
                    c1 += w1 * xc
                    c2 += w2 * xc
                    c3 += w3 * xc
                    d0 += w0 * xd
                    d1 += w1 * xd
                    d2 += w2 * xd
                    d3 += w3 * xd
                out[m, j] = a0
                out[m, j + 1] = a1
                out[m, j + 2] = a2
                out[m, j + 3] = a3
                out[m + 1, j] = b0
                out[m + 1, j + 1] = b1
                out[m + 1, j + 2] = b2
                out[m + 1, j + 3] = b3
                out[m + 2, j] = c0
                out[m + 2, j + 1] = c1
                out[m + 2, j + 2] = c2
                out[m + 2, j + 3] = c3
                out[m + 3, j] = d0
                out[m + 3, j + 1] = d1
                out[m + 3, j + 2] = d2
                out[m + 3, j + 3] = d3
    for j in range(4 * n4, n):  # columns past the last multiple of 4 (a fixed set for a given layer)
        for m in range(rows):
            acc = np.float32(0.0)
            for k in range(k_dim):
                acc += w[j, k] * x[m, k]
            out[m, j] = acc


def linear_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [M, K] @ w[N, K].T with `small_matmul`; M is padded with zero rows to a multiple of 4
    (dropped again)."""
    rows = x.shape[0]
    if rows % 4:
        x = np.concatenate([x, np.zeros((4 - rows % 4, x.shape[1]), dtype=x.dtype)])
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    small_matmul(x, w, out)
    return out[:rows]


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear that runs inputs of MIN_ROWS to MAX_ROWS rows through `small_matmul` (inference only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        out = torch.from_numpy(linear_rows(x.reshape(rows, -1).contiguous().numpy(),
                                           self.weight.detach().numpy()))  # [M, N]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


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
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None  # [B, Q, H, D]


AttentionInterface.register(ATTENTION, gqa_attention)
# masks built as for sdpa: without this transformers passes no mask at all to an attention function
# it does not know, and sdpa then reads "no mask, several queries" as a causal prefill
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


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


def full_attention(config: Any) -> bool:
    """Whether every layer attends to the whole sequence (no sliding window)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return not getattr(config, "sliding_window", None) and all(t == "full_attention" for t in layer_types)


def new_cache(model: Any) -> Any:
    """The KV cache to decode `model` with: a GrowingCache when every layer is full attention."""
    return GrowingCache() if full_attention(model.config) else DynamicCache(config=model.config)


def accelerate(model: Any) -> list[str]:
    """Switch `model` (in place) to the small-batch linear layers (CPU, float32) and the grouped-query
    attention (sdpa models); returns what was switched, for --verbose."""
    done = []
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if model.device.type == "cpu" and model.dtype == torch.float32 and linears and all(
            m.weight.is_contiguous() for m in linears):
        for m in linears:
            m.__class__ = SmallBatchLinear
        done.append(f"small-batch linear ({len(linears)} layers)")
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION)
        done.append("grouped-query attention")
    return done
