"""How the quantized engine's cache keeps values, and how a row's weights p sum them: a = sum_j p_j v_j
(core/model/quantized/attention.py runs these for each part of the context).

Values lie in tiles of 16 positions, [Hkv, C / 16, rows, width] (`value_layout`):

    bf16  (the default where the CPU has AVX512-BF16: Zen 4 and 5, Sapphire Rapids and after) eight
          rows of D words, a word holding two positions' bfloat16 of one dimension (2r low, 2r + 1
          high). A row's weights are rounded to bfloat16 as well, and vdpbf16ps takes two positions
          a lane in one instruction: half float32's multiply-adds for the same bytes. Other CPUs
          run the same arithmetic in plain vector IR (its two multiply-adds, the odd position's
          first, as Intel's manual writes it: the same bits, far slower).
    f16   (the default elsewhere) float16 bits, a row a position, widened to float32 as they are
          read, a multiply-add a position.

Pairs are a row's own positions 2k, 2k + 1 in its sequence's order (attention gathers a tree
branch's entries so), so the sums are the same whatever pass the row is in.
examples/kv_keys_quality.py measures what bfloat16 values change against float16 ones on real logs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fix_module, fixed
from .ir import F32, I32, I64, counted, f32_bits, load_halves, splat
from .ir import fma as fma16
from .keys import LANES, store_keys_f16
from .target import has_bf16, isa

configure_numba_cache()

FORMATS = ("bf16", "f16")
"""How the cache keeps values: bf16 (bfloat16, summed two positions an instruction where the CPU has
AVX512-BF16) or f16 (float16, widened as read)."""


def check_values(values: str) -> str:
    """`values` if it names a way of keeping values (FORMATS), else a ValueError saying which do."""
    if values not in FORMATS:
        raise ValueError(f"values {values!r}: one of {', '.join(FORMATS)}")
    return values


def bf16_dots(family: str) -> bool:
    """Whether instruction-set `family`'s kernels sum bfloat16 pairs with vdpbf16ps (the AVX-512 family
    on a CPU numba compiles for with AVX512-BF16), not in plain IR."""
    return family == "avx512vnni" and has_bf16()


def default_values() -> str:
    """bf16 where the CPU numba compiles for sums bfloat16 pairs in one instruction, else f16 (on
    others the bfloat16 arithmetic would run as plain float32 operations, slower than float16's)."""
    return "bf16" if bf16_dots(isa()) else "f16"


def value_layout(dim: int, values: str) -> tuple[int, int, type]:
    """(rows, width, dtype) of a tile of 16 positions' values of `dim` dimensions: the cache's values are
    [Hkv, C / 16, rows, width]."""
    check_values(values)
    if dim % LANES:
        raise ValueError(f"values of heads of a multiple of {LANES} dimensions, not {dim}")
    return (LANES // 2, dim, np.uint32) if values == "bf16" else (LANES, dim, np.uint16)


def _weighted_f16_kernel(dim: int, group: int) -> Any:
    """weighted(v [Hkv, T, 16, D] float16 bits, g, p [G, W], pairs, start, count, acc [G, D]) (pairs
    unread): acc[h] += sum over
    j < count of p[h, start + j] v[g, j] for h < G = `group` (acc read first, written after), D =
    `dim`, a multiple of 16. Each head's sum runs over j in order (its own chains of D / 16
    multiply-adds); the group's heads share each value vector's load."""
    vectors = dim // LANES
    vec = ir.VectorType(F32, LANES)

    @intrinsic
    def weighted(typingctx, v, g, p, pairs, start, count, acc):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            v_a, p_a, acc_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 6))
            g_, start_, count_ = args[1], args[4], args[5]
            cap = builder.mul(builder.extract_value(v_a.shape, 1), ir.Constant(I64, LANES))
            width = builder.extract_value(p_a.shape, 1)
            const = lambda c: ir.Constant(I64, c)  # noqa: E731
            fma = fma16(builder)
            ptr = lambda base, idx: builder.bitcast(builder.gep(base, [idx]), vec.as_pointer())  # noqa: E731
            at = lambda h, i: const(h * dim + LANES * i)  # noqa: E731 - acc[h, 16 i]
            first = [builder.load(ptr(acc_a.data, at(h, i)), align=4) for h in range(group) for i in range(vectors)]

            def position(j: Any, acc: list[Any]) -> list[Any]:
                row = builder.mul(builder.add(builder.mul(g_, cap), j), const(dim))
                value = [load_halves(builder, v_a.data, builder.add(row, const(LANES * i))) for i in range(vectors)]
                new = []
                for h in range(group):
                    pj = builder.add(builder.mul(const(h), width), builder.add(start_, j))
                    weight = splat(builder, builder.load(builder.gep(p_a.data, [pj])), vec)
                    new += [builder.call(fma, [weight, value[i], acc[h * vectors + i]]) for i in range(vectors)]
                return new

            final = counted(builder, const(0), count_, 1, first, position)
            for h in range(group):
                for i in range(vectors):
                    builder.store(final[h * vectors + i], ptr(acc_a.data, at(h, i)), align=4)
            return context.get_dummy_value()

        return types.void(v, g, p, pairs, start, count, acc), codegen

    return fixed(weighted, f"qvalues.weighted_f16.{dim}.{group}")


class _BFloat(ir.types.Type):
    """LLVM's bfloat (llvmlite has no such type): vdpbf16ps's operands are <32 x bfloat>."""

    def _to_string(self) -> str:
        return "bfloat"

    def __reduce__(self) -> tuple:  # pickled the same before and after printing (core/numba_cache.py)
        return _BFloat, ()


def bf16_pairs(builder: ir.IRBuilder, p: Any) -> Any:
    """Sixteen float32 weights (finite, >= 0) as eight words of two bfloat16 (ties to even; position 2r
    low, 2r + 1 high): what _weighted_bf16_kernel reads (attention's softmax writes them)."""
    vi, v8 = ir.VectorType(I32, LANES), ir.VectorType(I32, LANES // 2)
    ints = lambda c: ir.Constant(vi, [c] * LANES)  # noqa: E731
    bits = builder.bitcast(p, vi)
    odd = builder.and_(builder.lshr(bits, ints(16)), ints(1))
    half = builder.lshr(builder.add(bits, builder.add(odd, ints(0x7FFF))), ints(16))
    pick = lambda k: builder.shuffle_vector(half, ir.Constant(vi, ir.Undefined),  # noqa: E731
                                            ir.Constant(v8, list(range(k, LANES, 2))))
    return builder.or_(pick(0), builder.shl(pick(1), ir.Constant(v8, [16] * (LANES // 2))))


def _weighted_bf16_kernel(dim: int, group: int, hardware: bool) -> Any:
    """weighted(v [Hkv, T, 8, D] bfloat16 pairs, g, p, pairs [G, W / 2], start, count, acc [G, D]) (p
    unread): acc[h] += sum over j < count of w[h, start + j] v[g, j] (`start` a multiple of 16; v from
    its first tile), w the weights as bfloat16 pairs (bf16_pairs, 0 past count to the end of its
    tile): per pair of positions and lane d, acc += w_2k+1 v_2k+1,d then += w_2k v_2k,d (each
    product exact in float32, each sum rounded), by vdpbf16ps where `hardware`, else the same
    operations in plain vector IR. The group's heads share each value vector's load; a head's
    weight pairs are read from memory broadcast (a load, not a shuffle)."""
    vectors = dim // LANES
    vf, vi = ir.VectorType(F32, LANES), ir.VectorType(I32, LANES)
    vbf = ir.VectorType(_BFloat(), 2 * LANES)

    @intrinsic
    def weighted(typingctx, v, g, p, pairs, start, count, acc):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            v_a, w_a, acc_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 6))
            g_, start_, count_ = args[1], args[4], args[5]
            tiles = builder.extract_value(v_a.shape, 1)
            width = builder.extract_value(w_a.shape, 1)
            const = lambda c: ir.Constant(I64, c)  # noqa: E731
            ints = lambda c: ir.Constant(vi, [c] * LANES)  # noqa: E731
            ptr = lambda base, idx, vec: builder.bitcast(builder.gep(base, [idx]), vec.as_pointer())  # noqa: E731
            at = lambda h, i: const(h * dim + LANES * i)  # noqa: E731 - acc[h, 16 i]
            if hardware:
                dp = builder.module.declare_intrinsic("llvm.x86.avx512bf16.dpbf16ps.512",
                                                      fnty=ir.FunctionType(vf, [vf, vbf, vbf]))
                dot = lambda a, w, x: builder.call(dp, [a, builder.bitcast(w, vbf), builder.bitcast(x, vbf)])  # noqa: E731
            else:
                def dot(a: Any, w: Any, x: Any) -> Any:
                    high = lambda y: builder.bitcast(builder.and_(y, ints(-65536)), vf)  # noqa: E731
                    low = lambda y: builder.bitcast(builder.shl(y, ints(16)), vf)  # noqa: E731
                    a = builder.fadd(a, builder.fmul(high(w), high(x)))
                    return builder.fadd(a, builder.fmul(low(w), low(x)))
            first = [builder.load(ptr(acc_a.data, at(h, i), vf), align=4) for h in range(group) for i in range(vectors)]
            ntiles = builder.udiv(builder.add(count_, const(LANES - 1)), const(LANES))
            word0 = builder.udiv(start_, const(2))

            def tile(t: Any, acc: list[Any]) -> list[Any]:
                base = builder.mul(builder.add(builder.mul(g_, tiles), t), const(LANES // 2 * dim))
                words = builder.add(word0, builder.mul(t, const(LANES // 2)))
                new = list(acc)
                for r in range(LANES // 2):  # a pair's weights for every head, then each value vector
                    w = [splat(builder, builder.load(builder.gep(w_a.data, [builder.add(
                        builder.mul(const(h), width), builder.add(words, const(r)))])), vi) for h in range(group)]
                    for i in range(vectors):
                        x = builder.load(ptr(v_a.data, builder.add(base, const(r * dim + LANES * i)), vi), align=4)
                        for h in range(group):
                            new[h * vectors + i] = dot(new[h * vectors + i], w[h], x)
                return new

            final = counted(builder, const(0), ntiles, 1, first, tile)
            for h in range(group):
                for i in range(vectors):
                    builder.store(final[h * vectors + i], ptr(acc_a.data, at(h, i), vf), align=4)
            return context.get_dummy_value()

        return types.void(v, g, p, pairs, start, count, acc), codegen

    return fixed(weighted, f"qvalues.weighted_bf16.{dim}.{group}.{'dp' if hardware else 'ir'}")


def weighted_kernel(values: str, group: int, dim: int, family: str) -> Any:
    """weighted(v, g, p [G, W], pairs [G, W / 2], start, count, acc [G, D]) for values kept as `values`:
    acc[h] += the sum over j < count of p[h, start + j] times value j of head g (from v's first
    tile); bfloat16 values read the weights as bfloat16 pairs (bf16_pairs), by vdpbf16ps in the
    avx512vnni `family` where the CPU has it, else in plain IR."""
    value_layout(dim, values)
    if values == "f16":
        return _weighted_f16_kernel(dim, group)
    return _weighted_bf16_kernel(dim, group, bf16_dots(family))


@njit(nogil=True, cache=True)
def store_values_f16(vc, v, first, last, at):  # pragma: no cover - compiled
    """Rows first..last-1 of v [S, Hkv, D] into float16 values vc at positions at, at + 1, ...: float16
    keys' store on the tiles seen position-last ([Hkv, T, D, 16], the keys' layout)."""
    store_keys_f16(vc.transpose((0, 1, 3, 2)), v, first, last, at)


@njit(nogil=True, cache=True)
def to_bfloat(x):  # pragma: no cover - compiled
    """A float32's nearest bfloat16 (ties to even; subnormals to zero, as vdpbf16ps reads them), its bits."""
    bits = f32_bits(x)
    if bits & np.uint32(0x7F800000) == 0:
        return np.uint32((bits >> np.uint32(16)) & np.uint32(0x8000))
    return np.uint32((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(nogil=True, cache=True)
def store_values_bf16(vc, v, first, last, at):  # pragma: no cover - compiled
    """Rows first..last-1 of v [S, Hkv, D] into bfloat16 values vc at positions at, at + 1, ...: position
    p in the low half of row p % 16 // 2's words if even, else the high half."""
    for s in range(first, last):
        p = at + s - first
        t, r, shift = p // 16, p % 16 // 2, np.uint32(16 * (p % 2))
        keep = np.uint32(0xFFFF0000) >> shift
        for hh in range(v.shape[1]):
            for d in range(v.shape[2]):
                vc[hh, t, r, d] = (vc[hh, t, r, d] & keep) | (to_bfloat(v[s, hh, d]) << shift)


@njit(nogil=True, cache=True)
def copy_value_f16(dst, dh, dp, src, sh, sp):  # pragma: no cover - compiled
    """Position sp of head sh in float16 values src to position dp of head dh in dst."""
    for d in range(dst.shape[3]):
        dst[dh, dp // 16, dp % 16, d] = src[sh, sp // 16, sp % 16, d]


@njit(nogil=True, cache=True)
def copy_value_bf16(dst, dh, dp, src, sh, sp):  # pragma: no cover - compiled
    """Position sp of head sh in bfloat16 values src to position dp of head dh in dst."""
    ss, ds = np.uint32(16 * (sp % 2)), np.uint32(16 * (dp % 2))
    keep = np.uint32(0xFFFF0000) >> ds
    for d in range(dst.shape[3]):
        half = (src[sh, sp // 16, sp % 16 // 2, d] >> ss) & np.uint32(0xFFFF)
        dst[dh, dp // 16, dp % 16 // 2, d] = (dst[dh, dp // 16, dp % 16 // 2, d] & keep) | (half << ds)


@njit(nogil=True, cache=True)
def move_value_f16(vc, dst, src):  # pragma: no cover - compiled
    """Position src of every head to position dst (float16 values)."""
    for h in range(vc.shape[0]):
        copy_value_f16(vc, h, dst, vc, h, src)


@njit(nogil=True, cache=True)
def move_value_bf16(vc, dst, src):  # pragma: no cover - compiled
    """Position src of every head to position dst (bfloat16 values)."""
    for h in range(vc.shape[0]):
        copy_value_bf16(vc, h, dst, vc, h, src)


def value_store(values: str) -> Any:
    """store_values(vc, v [S, Hkv, D], first, last, at) for values kept as `values` (compiled)."""
    return store_values_bf16 if check_values(values) == "bf16" else store_values_f16


def value_copy(values: str) -> Any:
    """copy_value(dst, dst_head, dst_position, src, src_head, src_position) for values kept as `values`."""
    return copy_value_bf16 if check_values(values) == "bf16" else copy_value_f16


def value_move(values: str) -> Any:
    """move_value(vc, dst, src): position src of every head of a layer's values to position dst."""
    return move_value_bf16 if check_values(values) == "bf16" else move_value_f16


def stored_values(vc: np.ndarray, n: int, values: str) -> np.ndarray:
    """Positions 0..n-1 of one layer's values vc as float32 [n, Hkv, D]: what the cache holds."""
    if values == "f16":
        return vc.reshape(vc.shape[0], -1, vc.shape[3])[:, :n].view(np.float16).astype(np.float32).transpose(1, 0, 2)
    halves = vc.view(np.uint16).reshape(*vc.shape[:3], vc.shape[3], 2)  # [Hkv, T, 8, D, 2] (little-endian)
    ordered = halves.transpose(0, 1, 2, 4, 3).reshape(vc.shape[0], -1, vc.shape[3])[:, :n]  # [Hkv, C, D]
    return (ordered.astype(np.uint32) << 16).view(np.float32).transpose(1, 0, 2)


fix_module(globals())
