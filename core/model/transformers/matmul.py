"""**Linear layers.** MKL's sgemm runs 1-3 rows as a matrix-vector product but from 4 rows on
packs the weight matrix into a scratch buffer first, which on a model that does not fit in
cache triples the memory traffic. `panel_matmul` keeps a copy of each weight packed in panels
of 16 output features and streams it from memory once per pass. It walks the weights in tiles
of 3 panels x 64 k (12 KB, L1-resident): the first group of 8 rows reads a tile from memory
(prefetching the next one), the other groups of 8 (and a last one of 4) reuse it from L1. A
micro-kernel (LLVM IR) computes 8 rows x 3 panels in 24 vector registers, one fused multiply-
add per (row, panel) for each k, each row's x[m, k] broadcast from memory. So 4-64 rows cost
little more than one until the arithmetic catches up with the memory traffic. It is
batch-invariant: a row's result is the same bits whatever the other rows are and however many
(each output is one multiply-add chain over k in order, whatever the tiling), so a decoding step's
row gets the bits it gets in a verification pass. One to three rows (plain decoding) run it too,
padded to 4: on an AMD EPYC (AVX-512) MKL's matrix-vector product is 1.3-3x slower than the panel
kernel on the built-in model's layers (10 ms against 4.4 ms for the 49152-row output layer), on
the Intel machine it was measured on first about as fast. Larger inputs (prefill) stay on MKL,
as in stock PyTorch. The packed copy doubles the memory of the linear layers' weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache

configure_numba_cache()  # before any kernel here is decorated

# Rows that go through panel_matmul (measured on the built-in model, linear layers alone): up to 64
# the panel kernel beats MKL's blocked GEMM, and is at least as fast as its matrix-vector product
# for 1-3 rows (examples/kernel_bench.py measures both, and whole passes).
MIN_ROWS, MAX_ROWS = 1, 64

PANEL = 16  # output features per packed panel: one 512-bit vector of float32
TILE_PANELS = 3  # panels per tile: 8 rows x 3 panels = 24 accumulators of the 32 vector registers
TILE_K = 64  # k per tile: 3 x 64 x 64 bytes = 12 KB, well inside L1 with the next tile's prefetch
PACK = PANEL * TILE_PANELS  # N is zero-padded to a multiple of a tile's width
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_VEC = ir.VectorType(_F32, PANEL)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """A Linear's weight [N, K] as panels [P, K, 16]: panel p holds output features 16p..16p+15,
    k-major, so that one 64-byte load at (p, k) gives all sixteen; N is zero-padded to PACK."""
    n, k = w.shape
    padded = np.zeros((-(-n // PACK) * PACK, k), dtype=np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(-1, PANEL, k).transpose(0, 2, 1))


def _tile(rows: int, prefetch: bool) -> Any:
    """An LLVM-IR micro-kernel: for rows r0..r0+rows-1 of x (given transposed, xt [K, M]) and
    panels p0..p0+2, out[r, 16 p : 16 p + 16] (+)= sum over k in [k0, k1) of x[r, k] W-panel[p, k].
    It starts from zero at k0 = 0 and from `out` after. Outer-product form: for each k, one vector
    load per panel, each row's x[m, k] broadcast, one fused multiply-add per (row, panel) into
    accumulators that stay in registers. With `prefetch`, the same panels' next tile (TILE_K
    further along k) is prefetched into L1. Every output is one FMA chain over k in order, so
    its bits depend neither on the rows beside it nor on how k is split."""
    panels = TILE_PANELS

    @intrinsic
    def tile(typingctx, xt, packed, out, p0, r0, k0, k1):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            x_arr, w_arr, out_arr = (context.make_array(t)(context, builder, a)
                                     for t, a in zip(signature.args[:3], args[:3]))
            xd, wd, od = x_arr.data, w_arr.data, out_arr.data
            p0_, r0_, k0_, k1_ = args[3:]
            k_dim = builder.extract_value(w_arr.shape, 1)
            m_dim = builder.extract_value(x_arr.shape, 1)
            n_out = builder.extract_value(out_arr.shape, 1)
            fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_VEC, [_VEC] * 3))
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch_fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
                ir.VoidType(), [byte_ptr, _I32, _I32, _I32]))
            const = lambda v: ir.Constant(_I64, v)  # noqa: E731
            vec_ptr = lambda p: builder.bitcast(p, _VEC.as_pointer())  # noqa: E731
            out_at = [[builder.gep(od, [builder.add(builder.mul(builder.add(r0_, const(m)), n_out),
                                                    builder.mul(builder.add(p0_, const(j)), const(PANEL)))])
                       for j in range(panels)] for m in range(rows)]
            first = builder.icmp_signed("==", k0_, const(0))
            zero = ir.Constant(_VEC, None)
            start = [[builder.select(first, zero, builder.load(vec_ptr(out_at[m][j]), align=4))
                      for j in range(panels)] for m in range(rows)]
            entry, loop, done = builder.block, builder.append_basic_block("loop"), builder.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            k = builder.phi(_I64)
            k.add_incoming(k0_, entry)
            acc = [[builder.phi(_VEC) for _ in range(panels)] for _ in range(rows)]
            for m in range(rows):
                for j in range(panels):
                    acc[m][j].add_incoming(start[m][j], entry)

            def panel_at(j: int, kk: Any) -> Any:  # flat index of packed[p0 + j, kk, 0]
                return builder.mul(builder.add(builder.mul(builder.add(p0_, const(j)), k_dim), kk), const(PANEL))

            w = [builder.load(vec_ptr(builder.gep(wd, [panel_at(j, k)])), align=4) for j in range(panels)]
            if prefetch:  # the next tile's line (read, keep in L1, data)
                for j in range(panels):
                    ahead = builder.gep(wd, [panel_at(j, builder.add(k, const(TILE_K)))])
                    builder.call(prefetch_fn, [builder.bitcast(ahead, byte_ptr), ir.Constant(_I32, 0),
                                               ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
            x_k = builder.gep(xd, [builder.add(builder.mul(k, m_dim), r0_)])  # &xt[k, r0]
            new = []
            for m in range(rows):
                xm = builder.load(builder.gep(x_k, [const(m)]))
                splat = builder.shuffle_vector(builder.insert_element(ir.Constant(_VEC, ir.Undefined), xm,
                                                                      ir.Constant(_I32, 0)),
                                               ir.Constant(_VEC, ir.Undefined),
                                               ir.Constant(ir.VectorType(_I32, PANEL), [0] * PANEL))
                new.append([builder.call(fma, [splat, w[j], acc[m][j]]) for j in range(panels)])
            k_next = builder.add(k, const(1))
            k.add_incoming(k_next, builder.block)
            for m in range(rows):
                for j in range(panels):
                    acc[m][j].add_incoming(new[m][j], builder.block)
            builder.cbranch(builder.icmp_signed("<", k_next, k1_), loop, done)
            builder.position_at_end(done)
            for m in range(rows):
                for j in range(panels):
                    builder.store(new[m][j], vec_ptr(out_at[m][j]), align=4)
            return context.get_dummy_value()

        return types.void(xt, packed, out, p0, r0, k0, k1), codegen

    return tile


_tile8_first, _tile8, _tile4_first, _tile4 = _tile(8, True), _tile(8, False), _tile(4, True), _tile(4, False)


@njit(parallel=True, nogil=True)
def _panel_matmul(xt: np.ndarray, packed: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    rows, k_dim = xt.shape[1], packed.shape[1]
    for b in prange(packed.shape[0] // TILE_PANELS):  # columns of tiles, split between the threads
        p0 = np.int64(b * TILE_PANELS)
        for k0 in range(0, k_dim, TILE_K):
            k1 = min(k0 + TILE_K, k_dim)
            if rows >= 8:  # the first group reads the tile from memory and prefetches the next
                _tile8_first(xt, packed, out, p0, np.int64(0), np.int64(k0), np.int64(k1))
                r = 8
            else:
                _tile4_first(xt, packed, out, p0, np.int64(0), np.int64(k0), np.int64(k1))
                r = 4
            while r + 8 <= rows:  # the others find it in L1
                _tile8(xt, packed, out, p0, np.int64(r), np.int64(k0), np.int64(k1))
                r += 8
            if r < rows:
                _tile4(xt, packed, out, p0, np.int64(r), np.int64(k0), np.int64(k1))


def panel_matmul(x: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """x [M, K] @ W.T -> [M', 16 P] for `packed` = pack_weight(W), M' being M rounded up to a
    multiple of 4 (x is padded with zero rows, transposed in the same copy); compiled on first use
    (a few seconds)."""
    rows, k_dim = x.shape
    padded = -(-rows // 4) * 4
    xt = np.zeros((k_dim, padded), dtype=np.float32)  # [K, M']
    xt[:, :rows] = x.T
    out = np.empty((padded, packed.shape[0] * PANEL), dtype=np.float32)
    _panel_matmul(xt, packed, out)
    return out


def linear_rows(x: np.ndarray, packed: np.ndarray, n: int) -> np.ndarray:
    """x [M, K] @ W[:n].T with `panel_matmul`, `packed` = pack_weight(W)."""
    return panel_matmul(x, packed)[: x.shape[0], :n]


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear that runs inputs of MIN_ROWS to MAX_ROWS rows through `panel_matmul` (inference
    only) on a packed copy of its weight, made by `pack()` (or at first use): the weight as it is
    then; a later change of the weight needs another `pack()`."""

    def pack(self) -> None:
        self._specx_packed = pack_weight(self.weight.detach().numpy())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not MIN_ROWS <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        if "_specx_packed" not in self.__dict__:
            self.pack()
        out = linear_rows(x.reshape(rows, -1).numpy(), self._specx_packed, self.out_features)
        out = torch.from_numpy(np.ascontiguousarray(out))  # [M, N]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)
