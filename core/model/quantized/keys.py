"""How the quantized engine's cache keeps keys, and how a query is scored against them
(core/model/quantized/attention.py runs these for each part of the context).

Keys lie in tiles of 16 positions, one vector lane per key, [Hkv, C / 16, rows, 16] (`key_layout`):

    q8   (the default) per 32 dimensions, eight rows of words holding four dimensions of a key as
         int8 + 128, then a row of the 16 keys' float32 scales: each key head's vector quantized
         as the linear layers' inputs are (d = max|k| / 127, rint(k / d); llama.cpp's
         `--cache-type-k q8_0` keeps keys the same way). The query is quantized the same way, and
         the instruction-set family's dot of four u8 x s8 a lane (core/model/quantized/arch/)
         gives each 32 dimensions' exact integer sum: a quarter of float32's multiply-adds and
         56% of float16's bytes.
    f16  float16 bits, a row per dimension, widened to float32 as they are read.

Either way a key's score is one fixed sequence of operations on that key and that query alone:
exact whatever pass a row is in, and (integer sums being exact) the same bits in every family.
examples/kv_keys_quality.py measures what int8 keys change against float16 ones on real logs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fix_module, fixed
from .arch import FAMILIES
from .ir import F32, I32, I64, f32_bits, load_halves, loop_back, splat, to_half
from .ir import fma as fma16
from .kernel import quantize_rows
from .quant import FORMATS

configure_numba_cache()

LANES = 16  # keys per tile, a vector lane each
_V16 = ir.VectorType(F32, LANES)


def _scores_kernel(group: int) -> Any:
    """scores(kt [Hkv, C / 16, D, 16] float16 bits, g, q [G, D], qw, qd, qs, col0, out [G, W], count) (qw,
    qd, qs, col0: the query's int8 form, which float16 keys do not read): out[h, j] = q[h] . key j of
    head g (kt[g, j // 16, :, j % 16]) for j < count rounded up to 16 (C and W at least that),
    h < G = `group`. Two tiles of 16 keys at a time (2 G multiply-add chains in flight, each key's
    own chain over the head dimension in order), then the odd tile alone."""

    @intrinsic
    def scores(typingctx, kt, g, q, qw, qd, qs, col0, out, count):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            kt_a, q_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 7))
            g_, count_ = args[1], args[8]
            tiles = builder.extract_value(kt_a.shape, 1)
            dim = builder.extract_value(kt_a.shape, 2)
            width = builder.extract_value(out_a.shape, 1)
            const = lambda v: ir.Constant(I64, v)  # noqa: E731
            fma = fma16(builder)
            blocks = builder.udiv(builder.add(count_, const(LANES - 1)), const(LANES))
            pairs = builder.mul(builder.udiv(blocks, const(2)), const(2))

            def tiles_loop(span: int, first: Any, limit: Any) -> None:
                """Tiles first, first + span, ... while below `limit`, `span` tiles an iteration."""
                entry = builder.block
                outer, inner, after, done = (builder.append_basic_block(f"{n}{span}")
                                             for n in ("outer", "inner", "after", "done"))
                builder.cbranch(builder.icmp_signed("<", first, limit), outer, done)
                builder.position_at_end(outer)
                jb = builder.phi(I64)
                jb.add_incoming(first, entry)
                outer_block = builder.block
                builder.branch(inner)
                builder.position_at_end(inner)
                d = builder.phi(I64)
                d.add_incoming(const(0), outer_block)
                acc = [builder.phi(_V16) for _ in range(span * group)]
                for a in acc:
                    a.add_incoming(ir.Constant(_V16, None), outer_block)
                qs = [splat(builder, builder.load(builder.gep(q_a.data, [builder.add(builder.mul(const(h), dim), d)])),
                            _V16) for h in range(group)]
                new = []
                for t in range(span):
                    tile = builder.add(builder.mul(g_, tiles), builder.add(jb, const(t)))
                    keys = load_halves(builder, kt_a.data,
                                       builder.mul(builder.add(builder.mul(tile, dim), d), const(LANES)))
                    new += [builder.call(fma, [qs[h], keys, acc[t * group + h]]) for h in range(group)]
                loop_back(builder, d, const(1), dim, inner, after, zip(acc, new))
                for t in range(span):
                    j = builder.mul(builder.add(jb, const(t)), const(LANES))
                    for h in range(group):
                        at = builder.add(builder.mul(const(h), width), j)
                        builder.store(new[t * group + h], builder.bitcast(builder.gep(out_a.data, [at]),
                                                                          _V16.as_pointer()), align=4)
                loop_back(builder, jb, const(span), limit, outer, done)

            tiles_loop(2, const(0), pairs)
            tiles_loop(1, pairs, blocks)
            return context.get_dummy_value()

        return types.void(kt, g, q, qw, qd, qs, col0, out, count), codegen

    return fixed(scores, f"qattention.scores.{group}")


Q8_ROWS = 9  # rows of a tile per 32 dimensions of int8 keys: 8 of four dimensions a key, then the scales


def _scores_q8_kernel(group: int, dim: int, isa_name: str) -> Any:
    """scores(kt [Hkv, C / 16, D / 32 * 9, 16] int8 keys, g, q, qw [D / 4, N], qd [D / 32, N], qs [D / 16,
    N], col0, out [G, W], count): out[h, j] = the int8 query col0 + h (core.model.quantized.kernel.quantize_rows:
    qw four int8 a word, qd its scales, qs its sums per 16) . key j of head g, for j < count
    rounded up to 16. A tile of 16 keys holds, per 32 dimensions, eight rows of 16 words (key j's
    four dimensions 4r..4r+3, each int8 + 128) and a row of their 16 float32 scales, so one
    register load is four dimensions of 16 keys (8 in a 256-bit family's): per 32 dimensions the
    family's dot of four u8 x s8 a lane (core/model/quantized/arch/) gives the exact integer sum,
    then one conversion and a multiply-add by key scale x query scale, the blocks in order."""
    dots_family = FAMILIES[isa_name]
    lanes = dots_family.LANES
    vi32, vf32 = ir.VectorType(I32, lanes), ir.VectorType(F32, lanes)
    blocks, rows = dim // 32, dim // 32 * Q8_ROWS
    offset = FORMATS["Q8_0"].offset

    @intrinsic
    def scores(typingctx, kt, g, q, qw, qd, qs, col0, out, count):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            kt_a, qw_a, qd_a, qs_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                             for i in (0, 3, 4, 5, 7))
            g_, col0_, count_ = args[1], args[6], args[8]
            stride = builder.extract_value(qw_a.shape, 1)
            tiles = builder.extract_value(kt_a.shape, 1)
            width = builder.extract_value(out_a.shape, 1)
            const = lambda v: ir.Constant(I64, v)  # noqa: E731
            fma = fma16(builder, lanes)
            dots = dots_family.Dots(builder, FORMATS["Q8_0"], lanes)
            at = lambda base, idx, vec: builder.load(  # noqa: E731
                builder.bitcast(builder.gep(base, [idx]), vec.as_pointer()), align=4)
            # the query's words, scales and offset corrections (column col0 + h, row i): the same for every tile
            scalar = lambda base, i, h: builder.load(builder.gep(  # noqa: E731
                base, [builder.add(builder.mul(const(i), stride), builder.add(col0_, const(h)))]))
            words = [[splat(builder, scalar(qw_a.data, w, h), vi32) for w in range(dim // 4)] for h in range(group)]
            qscale = [[splat(builder, scalar(qd_a.data, b, h), vf32) for b in range(blocks)] for h in range(group)]
            fix = [[splat(builder, builder.mul(builder.add(scalar(qs_a.data, 2 * b, h), scalar(qs_a.data, 2 * b + 1, h)),
                                               ir.Constant(I32, offset)), vi32) for b in range(blocks)]
                   for h in range(group)]
            ntiles = builder.udiv(builder.add(count_, const(LANES - 1)), const(LANES))
            entry, loop, done = builder.block, builder.append_basic_block("loop"), builder.append_basic_block("done")
            builder.cbranch(builder.icmp_signed(">", ntiles, const(0)), loop, done)
            builder.position_at_end(loop)
            t = builder.phi(I64)
            t.add_incoming(const(0), entry)
            base = builder.mul(builder.add(builder.mul(g_, tiles), t), const(rows * LANES))
            for lane0 in range(0, LANES, lanes):
                acc: list[Any] = [None] * group
                for b in range(blocks):
                    row = lambda r: builder.add(base, const((Q8_ROWS * b + r) * LANES + lane0))  # noqa: E731
                    keys = dots.prepare([at(kt_a.data, row(r), vi32) for r in range(8)])
                    kscale = builder.bitcast(at(kt_a.data, row(8), vi32), vf32)
                    for h in range(group):
                        dot = dots.dot(keys, words[h][8 * b : 8 * b + 8])
                        if not dots.offset_done:
                            dot = builder.sub(dot, fix[h][b])
                        scale = builder.fmul(kscale, qscale[h][b])
                        value = builder.sitofp(dot, vf32)
                        acc[h] = builder.fmul(value, scale) if b == 0 else builder.call(fma, [value, scale, acc[h]])
                for h in range(group):
                    place = builder.add(builder.add(builder.mul(const(h), width), builder.mul(t, const(LANES))),
                                        const(lane0))
                    builder.store(acc[h], builder.bitcast(builder.gep(out_a.data, [place]), vf32.as_pointer()),
                                  align=4)
            loop_back(builder, t, const(1), ntiles, loop, done)
            return context.get_dummy_value()

        return types.void(kt, g, q, qw, qd, qs, col0, out, count), codegen

    return fixed(scores, f"qattention.scores_q8.{group}.{dim}.{isa_name}")


KEYS = ("q8", "f16")
"""How the cache keeps keys: q8 (the default: int8 per 32 dimensions with a float32 scale, as
llama.cpp's `--cache-type-k q8_0`, and scored in integers), or f16 (float16, widened as read)."""


def check_keys(keys: str) -> str:
    """`keys` if it names a way of keeping keys (KEYS), else a ValueError saying which do."""
    if keys not in KEYS:
        raise ValueError(f"keys {keys!r}: one of {', '.join(KEYS)}")
    return keys


def key_layout(dim: int, keys: str) -> tuple[int, type]:
    """(rows, dtype) of a tile of 16 keys of `dim` dimensions: the cache's keys are [Hkv, C / 16, rows, 16]."""
    check_keys(keys)
    if keys == "q8" and dim % 32:
        raise ValueError(f"int8 keys take heads of a multiple of 32 dimensions, not {dim}")
    return (dim // 32 * Q8_ROWS, np.uint32) if keys == "q8" else (dim, np.uint16)


@njit(nogil=True, cache=True)
def store_keys_f16(kc, k, first, last, at):  # pragma: no cover - compiled
    """Rows first..last-1 of k [S, Hkv, D] into float16 keys kc at positions at, at + 1, ..."""
    for s in range(first, last):
        p = at + s - first
        for hh in range(k.shape[1]):
            for d in range(k.shape[2]):
                kc[hh, p // 16, d, p % 16] = to_half(k[s, hh, d])


@njit(nogil=True, cache=True)
def store_keys_q8(kc, k, first, last, at):  # pragma: no cover - compiled
    """Rows first..last-1 of k [S, Hkv, D] into int8 keys kc at positions at, at + 1, ...: each key head's
    vector quantized as the linear layers' inputs are (core.model.quantized.kernel.quantize_rows),
    its int8 values + 128 four a word, its scales as float32 bits (`_scores_q8_kernel`'s layout)."""
    n, heads, dim = last - first, k.shape[1], k.shape[2]
    flat = np.ascontiguousarray(k[first:last]).reshape((n * heads, dim))
    q8 = np.empty((dim // 4, n * heads, 4), dtype=np.int8)
    dx = np.empty((dim // 32, n * heads), dtype=np.float32)
    sx = np.empty((dim // 16, n * heads), dtype=np.int32)
    xs = np.empty((dim // 32, n * heads), dtype=np.float32)
    quantize_rows(flat, q8, dx, sx, xs)
    words = q8.view(np.uint32).reshape((dim // 4, n * heads))  # four int8 a word, little-endian
    for s in range(n):
        p = at + s
        for hh in range(heads):
            m = s * heads + hh
            for b in range(dim // 32):
                for w in range(8):  # each byte's x + 128 is its bits with the top one flipped
                    kc[hh, p // 16, Q8_ROWS * b + w, p % 16] = words[8 * b + w, m] ^ np.uint32(0x80808080)
                kc[hh, p // 16, Q8_ROWS * b + 8, p % 16] = f32_bits(dx[b, m])


def scores_kernel(keys: str, group: int, dim: int, family: str) -> Any:
    """scores(kt, g, q [G, D], qw, qd, qs, col0, out [G, W], count) for keys kept as `keys`: out[h, j] =
    query h of the group . key j of head g, j < count rounded up to 16; float16 keys read the float
    query q, int8 keys its int8 form (qw, qd, qs at column col0 + h, core.model.quantized.kernel.quantize_rows'
    layout), scored by `family`'s dots."""
    key_layout(dim, keys)
    return _scores_q8_kernel(group, dim, family) if keys == "q8" else _scores_kernel(group)


def key_store(keys: str = "q8") -> Any:
    """store_keys(kc, k [S, Hkv, D], first, last, at) for keys kept as `keys` (compiled): rows
    first..last-1 of k into the layer's key cache kc at positions at, at + 1, ..."""
    return store_keys_q8 if check_keys(keys) == "q8" else store_keys_f16


fix_module(globals())
