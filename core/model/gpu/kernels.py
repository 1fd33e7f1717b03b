"""Batch-invariant Triton kernels for the GPU engine (core/model/gpu/model.py): a row's result is
the same bits whatever else is in the pass, so a tree pass, a prefill chunk or a batch of requests
gives every token the logits a one-token pass gives it (lossless speculation in bfloat16).

How (Thinking Machines' batch-invariant ops, vLLM's batch-invariant mode): no kernel chooses its
work split by the number of rows.

- `matmul`: x [M, K] @ w [N, K].T with one tiling (BLOCK_M x BLOCK_N tiles, K walked in BLOCK_K
  steps from 0 up, float32 accumulator, no split-K) for every M; a row's output depends on that row
  alone. Inputs are rounded to bfloat16 (round to nearest even, by bits: `bf16_round`) and the
  weights are bfloat16: on CUDA the products run on tensor cores, bf16 x bf16 into float32. The
  logits go through it too.
- `rms_norm` (with the residual add), `rope`, `silu_mul`: one program per row (or per row's
  block), float32, a fixed order over the row's own values.
- `attention`: one program per (query row, head). A row at position P sees exactly the positions
  0..P of its sequence (the cache, then its pending tokens and ancestors in the pass: the tree's
  columns listed in order), and walks them in blocks of BLOCK_KEYS *by position*, with an online
  softmax: the blocks, their contents and their order are the same in a one-token pass, a tree pass
  or a batch, so the sums are too. Masked keys and the other rows never enter the sums.

Arguments that count rows are never specialized (`do_not_specialize`): Triton compiles one kernel
for one row and for many.

Tested where: under TRITON_INTERPRET=1 on CPU tensors (tests/test_gpu_engine.py), with
`tensor_cores=False` (the interpreter computes bfloat16 products wrongly: numpy has no bfloat16;
it loads bfloat16 tensors right, so the weights are bfloat16 there too and widened in the kernel):
each kernel against torch, batch invariance bit for bit, the engine's speculation against its
plain decoding. The bf16 tensor-core path (`tensor_cores=True`, the default on CUDA) and the
kernels' speed are checked only on a GPU (examples/gpu_check.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # the one matmul tiling, whatever the rows
BLOCK_ROW = 1024  # a row's values per step in the row-wise kernels
BLOCK_KEYS = 32  # positions per step of attention


@triton.jit
def bf16_round(x):
    """float32 -> the nearest bfloat16 value (ties to even), still float32: the bits do it, the same
    on a GPU and in the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                   HAS_BIAS: tl.constexpr, TENSOR_CORES: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # one order over K, every row, every M
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_x + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        a = bf16_round(a)
        b = tl.load(w_ptr + rn[None, :] * stride_w + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)  # [BK, BN] bfloat16
        if TENSOR_CORES:
            acc = tl.dot(a.to(tl.bfloat16), b, acc)
        else:  # products and sums in one order for every row of the tile: tl.dot in the interpreter is numpy's BLAS,
            # whose micro-kernels sum a row differently by its place in the tile (seen on AMD Zen 5)
            acc += tl.sum(a[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           tensor_cores: bool = True) -> torch.Tensor:
    """x [M, K] (float32, rounded to bfloat16 as read) @ w [N, K].T (bfloat16) (+ bias [N], float32)
    -> [M, N] float32, one tiling for every M."""
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))  # rows fastest: a weight tile's readers run together
    _matmul_kernel[grid](x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                         HAS_BIAS=bias is not None, TENSOR_CORES=tensor_cores, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, N, eps, stride_x, stride_delta, stride_out,
                     RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, N, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0)
        if RESIDUAL:
            v += tl.load(delta_ptr + row * stride_delta + cols, mask=cols < N, other=0.0)
            tl.store(x_row + cols, v, mask=cols < N)
        acc += v * v
    scale = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    for c in range(0, N, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        tl.store(out_ptr + row * stride_out + cols, v * scale * w, mask=cols < N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, row by row (float32); with `delta`, x += delta first (in
    place: the residual stream) and the sum is the new x's."""
    rows, n = x.shape
    out = torch.empty_like(x)
    if rows:
        d = delta if delta is not None else x
        _rms_norm_kernel[(rows,)](x, d, weight, out, n, eps, x.stride(0), d.stride(0), out.stride(0),
                                  RESIDUAL=delta is not None, BLOCK=min(BLOCK_ROW, triton.next_power_of_2(n)))
    return out


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_x, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 NEOX: tl.constexpr, BLOCK: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(pos_ptr + row)
    c = tl.load(cos_ptr + pos * HALF + i, mask=mask, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + i, mask=mask, other=0.0)
    base = x_ptr + row * stride_x + head * HEAD_DIM
    if NEOX:
        ia, ib = i, i + HALF
    else:
        ia, ib = 2 * i, 2 * i + 1
    x0 = tl.load(base + ia, mask=mask, other=0.0)
    x1 = tl.load(base + ib, mask=mask, other=0.0)
    tl.store(base + ia, x0 * c - x1 * s, mask=mask)
    tl.store(base + ib, x0 * s + x1 * c, mask=mask)


def rope(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         neox: bool) -> None:
    """Rotate the first `heads` heads of each row of x [S, >= heads * head_dim] (float32) in place by
    its position's angles (tables [P, R/2], R <= head_dim rotated): pairs (2i, 2i+1) as llama.cpp's
    normal mode, or (i, i + R/2) (neox)."""
    if x.shape[0]:
        half = cos.shape[1]
        _rope_kernel[(x.shape[0], heads)](x, positions, cos, sin, x.stride(0), HEAD_DIM=head_dim, HALF=half,
                                          NEOX=neox, BLOCK=triton.next_power_of_2(half))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, F, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + F + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, g / (1.0 + tl.exp(-g)) * u, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for gate_up [S, 2F] = [g, u] -> [S, F] (float32)."""
    rows, width = gate_up.shape
    f = width // 2
    out = torch.empty((rows, f), dtype=torch.float32, device=gate_up.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(f, BLOCK_ROW))](gate_up, out, f, gate_up.stride(0), out.stride(0),
                                                            BLOCK=BLOCK_ROW)
    return out


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, meta_ptr, cols_ptr, out_ptr, scale, stride_q, stride_kv,
                      stride_out, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_q + head * HEAD_DIM + d, mask=dmask, other=0.0)
    table = tl.load(meta_ptr + row * 4)  # this row's sequence: its page table's start in pages_ptr,
    cached = tl.load(meta_ptr + row * 4 + 1)  # the entries its cache held before the pass,
    count = tl.load(meta_ptr + row * 4 + 2)  # the positions it sees (its own position + 1),
    first = tl.load(meta_ptr + row * 4 + 3)  # and where its visible columns of the pass are listed
    m = -float("inf")
    total = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, count, BLOCK_KEYS):  # by position: the same blocks in every pass
        j = start + tl.arange(0, BLOCK_KEYS)
        visible = j < count
        new = j >= cached
        col = tl.load(cols_ptr + first + (j - cached), mask=visible & new, other=0)
        slot = tl.where(new, cached + col, j)
        page = tl.load(pages_ptr + table + slot // PAGE, mask=visible, other=0)
        at = (page * PAGE + slot % PAGE) * stride_kv + kv_head * HEAD_DIM
        kmask = visible[:, None] & dmask[None, :]
        k = tl.load(k_ptr + at[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        s = tl.where(visible, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=kmask, other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + row * stride_out + head * HEAD_DIM + d, acc / total, mask=dmask)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor, meta: torch.Tensor,
              cols: torch.Tensor, heads: int, kv_heads: int, head_dim: int, page: int) -> torch.Tensor:
    """Each query row's attention over what it sees: q [S, >= heads * head_dim] (float32); keys,
    values [slots, kv_heads, head_dim] (one layer's pool, bfloat16, a page of `page` slots after
    another); meta [S, 4] int32 per row: (start of its page table in `pages`, entries cached
    before the pass, positions it sees, start of its columns in `cols`); cols: each row's visible
    columns of the pass (its sequence's own rows: pending tokens, ancestors, itself), in order.
    Position j < cached is slot j of the sequence, position cached + t is slot cached + cols[t].
    -> [S, heads * head_dim] float32."""
    rows = q.shape[0]
    out = torch.empty((rows, heads * head_dim), dtype=torch.float32, device=q.device)
    if rows:
        _attention_kernel[(rows, heads)](q, keys, values, pages, meta, cols, out, 1.0 / math.sqrt(head_dim),
                                         q.stride(0), keys.stride(0), out.stride(0), GROUP=heads // kv_heads,
                                         HEAD_DIM=head_dim, PAGE=page, BLOCK_D=triton.next_power_of_2(head_dim),
                                         BLOCK_KEYS=BLOCK_KEYS)
    return out
