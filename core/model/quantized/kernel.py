"""**Quantized linear layers**: x [M, K] @ W.T for a GGUF weight kept in its own bits (core/model/quantized/quant.py).

The activations are quantized per row, in blocks of 32 inputs, to int8 with a float scale (as
llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d)); a block's dot product with a weight block
is then exact integer arithmetic, scaled once:

    out[m, n] += s[n] * dx[m] * (sum_k q_w[n, k] q_x[m, k] - o * sum_k q_x[m, k]) + min[n] * dx[m] * sum_k q_x[m, k]

A micro-kernel (LLVM IR, like core/model/transformers/matmul.py's) holds a panel's outputs (sixteen in a
512-bit register, eight in a 256-bit one) for 1 to 8 rows in vector registers for the whole of K:
per 32 inputs it loads the weights once (4-bit values unpacked with two ands and a shift) and for
each row takes the integer dot products of four inputs a lane against that row's inputs broadcast,
then one conversion and two multiply-adds. So a pass reads each weight once from memory whatever
the rows; extra rows cost only their arithmetic. One kernel per instruction-set family, each in a
file of its own under arch/ (the same names in each) that declares the LLVM features it requires and
its rank; `driver` builds the one core/model/quantized/target.py's `isa()` names by default: the
highest-ranked family the CPU numba compiles for can run (the host, or the CPU NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES name):

    family       requires      dot of four u8 x s8 inputs a lane              lanes
    avx512vnni   avx512vnni    vpdpbusd zmm                                    16
    avxvnni      avxvnni       vpdpbusd ymm (Zen 5, Intel since Alder Lake)     8
    avx2         avx2          vpmaddubsw + vpmaddwd (ggml's AVX2 idiom)        8
    generic      nothing       plain vector IR with vpdpbusd's arithmetic      16

Rows go in tiles of 8, 4, 2 and 1 in every family.

The integer sums are exact in every family (arch/avx2.py says why none overflows), and the float
steps the same, so every family gives the same bits (tested). An Arm port would be one new file,
arch/neon.py (docs/quantized.md).

Batch-invariant: a row's outputs are one fixed sequence of exact integer sums and float
multiply-adds over K in order, whatever rows are beside it, however the rows are grouped and
whichever thread runs the panel; a row's quantization depends on that row alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fix_module, fixed
from .arch import FAMILIES
from .ir import F32, I8, I16, I32, I64
from .ir import fma as ir_fma
from .ir import loop_back, prefetch, splat
from .quant import BLOCK, PANEL, Format, Packed
from .target import isa

configure_numba_cache()  # before any kernel here is decorated

ROW_CHUNK = 64  # rows per kernel call: a chunk's quantized inputs stay in L2 while the panels stream
# rows a tile holds, every family alike: on 16 ymm registers 8 rows spill a few to L1 and still beat
# 4 rows by 6-20% (re-reading and unpacking a panel's weights per 4 rows costs more); docs/quantized.md
BIG_TILE = 8
ROUND = np.float32(1.5 * 2**23)  # (v + ROUND) - ROUND is rint(v), ties to even, for |v| < 2^22
# weight bytes prefetched ahead of the block being multiplied (eight blocks of 4-bit weights): the
# hardware prefetchers alone left a core's loads waiting on memory between compute bursts; with it
# one core's one-row pass over the built-in model went from ~4.4 to ~3.5 ms (docs/quantized.md)
PREFETCH = 2048
PARALLEL_VALUES = 1 << 15  # row-wise work goes to the threads from this many values (~30 us of it)

def _tile(rows: int, fmt: Format, isa_name: str) -> Any:
    """An LLVM-IR micro-kernel: out[r0 + m, 16 p + lane0 : 16 p + lane0 + L] = the rows
    r0..r0+rows-1 of the quantized inputs against L outputs (the family's LANES) of panel p of a
    Packed weight of format `fmt`, over all of K."""
    groups_per_sub = fmt.sub // 4  # groups of four inputs per scale
    subs = BLOCK // fmt.sub  # scales per block of 32
    lanes = FAMILIES[isa_name].LANES
    vi32, vf32 = ir.VectorType(I32, lanes), ir.VectorType(F32, lanes)

    @intrinsic
    def tile(typingctx, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, p, r0, lane0):  # pragma: no cover
        def codegen(context, builder, signature, args):
            arrs = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:10], args[:10])]
            vd, sd, md, kdd, kmd, xwd, dxd, sxd, xsd, od = (a.data for a in arrs)
            p_, r0_, lane0_ = args[10], args[11], args[12]
            nb = builder.extract_value(arrs[0].shape, 1)  # blocks of 32 along K
            m_dim = builder.extract_value(arrs[5].shape, 1)  # rows of the quantized inputs
            n_out = builder.extract_value(arrs[9].shape, 1)
            const = lambda v: ir.Constant(I64, v)  # noqa: E731
            fma = ir_fma(builder, lanes)
            dots = FAMILIES[isa_name].Dots(builder, fmt)
            vec_at = lambda ptr, idx, vec: builder.load(  # noqa: E731
                builder.bitcast(builder.gep(ptr, [idx]), vec.as_pointer()), align=1)
            vi8, vi16 = ir.VectorType(I8, lanes), ir.VectorType(I16, lanes)
            vhalf = ir.VectorType(ir.HalfType(), lanes)
            lane_bytes = builder.mul(lane0_, const(4))  # this tile's lanes within a 64-byte group

            def f16_vector(ptr: Any, index: Any) -> Any:  # L float16 at byte 32 * index + 2 * lane0
                raw = vec_at(ptr, builder.add(builder.mul(index, const(32)), builder.mul(lane0_, const(2))), vi16)
                return builder.fpext(builder.bitcast(raw, vhalf), vf32)

            def k_vector(ptr: Any, index: Any, signed: bool, d: Any) -> Any:  # L integers at byte 16 index + lane0, times d
                raw = vec_at(ptr, builder.add(builder.mul(index, const(16)), lane0_), vi8)
                wide = builder.sext(raw, vi32) if signed else builder.zext(raw, vi32)
                return builder.fmul(d, builder.sitofp(wide, vf32))

            row = [builder.add(r0_, const(m)) for m in range(rows)]
            entry, loop, done = builder.block, builder.append_basic_block("loop"), builder.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            b = builder.phi(I64)
            b.add_incoming(const(0), entry)
            acc = [builder.phi(vf32) for _ in range(rows)]
            for a in acc:
                a.add_incoming(ir.Constant(vf32, None), entry)
            pb = builder.add(builder.mul(p_, nb), b)  # (panel, block) index
            base = builder.add(builder.mul(pb, const(fmt.block_bytes)), lane_bytes)
            for line in range(0, fmt.block_bytes, 64):  # a later block's weights on their way to L1
                prefetch(builder, builder.gep(vd, [builder.add(base, const(PREFETCH + line))]))
            weights: list[Any] = [None] * 8  # 8 groups of four inputs for L outputs, <L x i32>
            if fmt.bits == 8:
                for g in range(8):
                    weights[g] = vec_at(vd, builder.add(base, const(64 * g)), vi32)
            else:
                low = ir.Constant(vi32, [0x0F0F0F0F] * lanes)
                for t in range(4):
                    both = vec_at(vd, builder.add(base, const(64 * t)), vi32)
                    weights[t] = builder.and_(both, low)
                    weights[t + 4] = builder.and_(builder.lshr(both, ir.Constant(vi32, [4] * lanes)), low)
                if fmt.bits == 6:
                    two = ir.Constant(vi32, [0x03030303] * lanes)
                    for u in range(2):
                        high = vec_at(vd, builder.add(base, const(256 + 64 * u)), vi32)
                        for i in range(4):
                            bits = builder.and_(builder.lshr(high, ir.Constant(vi32, [2 * i] * lanes)), two)
                            weights[4 * u + i] = builder.or_(weights[4 * u + i],
                                                             builder.shl(bits, ir.Constant(vi32, [4] * lanes)))
            weights = dots.prepare(weights)
            d256 = dmin256 = None
            if fmt.scale == "k":  # the 256-block's float32 d (and dmin) for L outputs
                k256 = builder.add(builder.mul(p_, builder.udiv(nb, const(8))), builder.udiv(b, const(8)))
                at = builder.add(builder.mul(k256, const(PANEL)), lane0_)
                d256 = vec_at(kdd, at, vf32)
                if fmt.has_min:
                    dmin256 = vec_at(kmd, at, vf32)
            new = list(acc)
            for s in range(subs):
                sub = builder.add(builder.mul(pb, const(subs)), const(s))  # (panel, sub-block) index
                scale = (f16_vector(sd, sub) if fmt.scale == "f16" else k_vector(sd, sub, fmt.signed, d256))
                group_ids = range(s * groups_per_sub, (s + 1) * groups_per_sub)
                for m in range(rows):
                    xs_m = [splat(builder, builder.load(builder.gep(xwd, [builder.add(builder.mul(builder.add(
                        builder.mul(b, const(8)), const(g)), m_dim), row[m])])), vi32) for g in group_ids]
                    dot = dots.dot([weights[g] for g in group_ids], xs_m)
                    if fmt.offset and not dots.offset_done:
                        # sums of the row's quantized inputs per 16: sx[2 b + h] for the halves in this sub-block
                        total = None
                        for h in ((s,) if fmt.sub == 16 else (0, 1)):
                            idx = builder.add(builder.mul(builder.add(builder.mul(b, const(2)), const(h)), m_dim), row[m])
                            v = builder.load(builder.gep(sxd, [idx]))
                            total = v if total is None else builder.add(total, v)
                        dot = builder.sub(dot, splat(builder, builder.mul(total, ir.Constant(I32, fmt.offset)), vi32))
                    d_row = builder.load(builder.gep(dxd, [builder.add(builder.mul(b, m_dim), row[m])]))
                    scaled = builder.fmul(scale, splat(builder, d_row, vf32))
                    new[m] = builder.call(fma, [builder.sitofp(dot, vf32), scaled, new[m]])
            if fmt.has_min:
                mins_v = (f16_vector(md, pb) if fmt.scale == "f16"
                          else builder.fneg(k_vector(md, pb, False, dmin256)))
                for m in range(rows):
                    xs_row = builder.load(builder.gep(xsd, [builder.add(builder.mul(b, m_dim), row[m])]))
                    new[m] = builder.call(fma, [mins_v, splat(builder, xs_row, vf32), new[m]])
            loop_back(builder, b, const(1), nb, loop, done, zip(acc, new))
            for m in range(rows):
                at = builder.add(builder.add(builder.mul(row[m], n_out), builder.mul(p_, const(PANEL))), lane0_)
                builder.store(new[m], builder.bitcast(builder.gep(od, [at]), vf32.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, p, r0, lane0), codegen

    return fixed(tile, f"qkernel.tile.{rows}.{fmt}.{isa_name}")


def _driver(fmt: Format, isa_name: str) -> Any:
    t8, t4, t2, t1 = (_tile(r, fmt, isa_name) for r in (BIG_TILE, 4, 2, 1))
    lanes = FAMILIES[isa_name].LANES
    halves = PANEL // lanes

    @njit(parallel=True, nogil=True, cache=True)
    def run(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out):  # pragma: no cover - compiled
        rows = xw.shape[1]
        for job in prange(values.shape[0] * halves):  # (panel, lanes) pairs, split between the threads
            pp = np.int64(job // halves)
            l0 = np.int64(job % halves * lanes)
            r = 0
            while r + BIG_TILE <= rows:
                t8(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r), l0)
                r += BIG_TILE
            if r + 4 <= rows:
                t4(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r), l0)
                r += 4
            if r + 2 <= rows:
                t2(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r), l0)
                r += 2
            if r < rows:
                t1(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r), l0)

    return fixed(run, f"qkernel.driver.{fmt}.{isa_name}")


_DRIVERS: dict[tuple[Format, str], Any] = {}


def driver(fmt: Format, isa_name: str | None = None) -> Any:
    """The compiled kernel for `fmt` in family `isa_name` (default: the target's; compiled on first
    use, a few seconds)."""
    key = (fmt, isa_name or isa())
    if key not in _DRIVERS:
        _DRIVERS[key] = _driver(*key)
    return _DRIVERS[key]


def any_driver(formats: tuple[Format, ...], isa_name: str | None = None) -> Any:
    """run_any(f, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out): the kernel of formats[f], callable
    from compiled code (core/model/quantized/forward.py's layers), where a model's layers mix formats."""
    key = (formats, isa_name or isa())
    if key not in _ANY:
        drivers = {f"d{i}": driver(fmt, key[1]) for i, fmt in enumerate(formats)}
        src = "def run_any(f, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out):\n" + "".join(
            f"    {'if' if i == 0 else 'elif'} f == {i}:\n        d{i}(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out)\n"
            for i in range(len(formats)))
        exec(compile(src, "<specx any_driver>", "exec"), drivers)  # noqa: S102 - generated from the format list only
        _ANY[key] = fixed(njit(nogil=True)(drivers["run_any"]), f"qkernel.any.{key[0]}.{key[1]}")
    return _ANY[key]


_ANY: dict[tuple[tuple[Format, ...], str], Any] = {}


@njit(nogil=True, cache=True, inline="always")
def _quantize_row(x, m, q8, dx, sx, xs, block, part):  # pragma: no cover - compiled
    """Row m of x into q8 / dx / sx / xs (Inputs' layout); `block` int32 [32] and `part` float32 [8]
    scratch. The maximum runs in eight lanes (one chain of 32 dependent maxima was most of the
    time) and the rounding by the float trick above (np.rint is a call numba does not inline):
    the same values as max() in order and np.rint."""
    k = x.shape[1]
    for b in range(k // 32):
        for i in range(8):
            part[i] = abs(x[m, 32 * b + i])
        for j in range(1, 4):
            for i in range(8):
                part[i] = max(part[i], abs(x[m, 32 * b + 8 * j + i]))
        amax = max(max(max(part[0], part[1]), max(part[2], part[3])), max(max(part[4], part[5]), max(part[6], part[7])))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
        for j in range(32):
            block[j] = min(127, max(-127, np.int32((x[m, 32 * b + j] * inv + ROUND) - ROUND)))
        s0, s1 = 0, 0
        for j in range(16):
            s0 += block[j]
            s1 += block[16 + j]
        for g in range(8):
            for i in range(4):
                q8[8 * b + g, m, i] = block[4 * g + i]
        dx[b, m] = d
        sx[2 * b, m] = s0
        sx[2 * b + 1, m] = s1
        xs[b, m] = d * np.float32(s0 + s1)


@njit(nogil=True, cache=True)
def _quantize_serial(x, q8, dx, sx, xs):  # pragma: no cover - compiled
    block, part = np.empty(32, dtype=np.int32), np.empty(8, dtype=np.float32)
    for m in range(x.shape[0]):
        _quantize_row(x, m, q8, dx, sx, xs, block, part)


@njit(nogil=True, cache=True, parallel=True)
def _quantize_parallel(x, q8, dx, sx, xs):  # pragma: no cover - compiled
    for m in prange(x.shape[0]):
        _quantize_row(x, m, q8, dx, sx, xs, np.empty(32, dtype=np.int32), np.empty(8, dtype=np.float32))


@njit(nogil=True, cache=True)
def quantize_rows(x, q8, dx, sx, xs):  # pragma: no cover - compiled
    """Each row of x [M, K] to int8 per block of 32 (d = max|x| / 127, q = rint(x / d)), its
    scales, sums per 16 and scaled sums per 32: a row's figures depend on that row alone, so rows
    go to the threads when there are many (a parallel region costs microseconds to start)."""
    if x.shape[0] * x.shape[1] >= PARALLEL_VALUES:
        _quantize_parallel(x, q8, dx, sx, xs)
    else:
        _quantize_serial(x, q8, dx, sx, xs)


class Inputs:
    """Rows x [M, K] quantized for the kernel: `xw` [K/4, M] int32 (four int8 inputs a word),
    `dx` [K/32, M] scales, `sx` [K/16, M] sums of the int8 inputs, `xs` [K/32, M] = dx * sums
    per 32. Made once per input and shared by every weight that reads it (q, k and v)."""

    def __init__(self, x: np.ndarray) -> None:
        rows, k = x.shape
        if k % BLOCK:
            raise ValueError(f"inputs of width {k}: the kernel takes multiples of {BLOCK}")
        q8 = np.empty((k // 4, rows, 4), dtype=np.int8)
        self.dx = np.empty((k // BLOCK, rows), dtype=np.float32)
        self.sx = np.empty((k // 16, rows), dtype=np.int32)
        self.xs = np.empty((k // BLOCK, rows), dtype=np.float32)
        quantize_rows(np.ascontiguousarray(x, dtype=np.float32), q8, self.dx, self.sx, self.xs)
        self.xw = q8.view(np.int32).reshape(k // 4, rows)
        self.rows, self.k = rows, k


def qmatmul(inputs: Inputs, weight: Packed, out: np.ndarray | None = None) -> np.ndarray:
    """inputs' rows @ weight.T -> [M, 16 P] float32 (the last panel's padding included)."""
    if inputs.k != weight.k:
        raise ValueError(f"inputs of width {inputs.k} against a weight of {weight.k}")
    width = weight.values.shape[0] * PANEL
    if out is None:
        out = np.empty((inputs.rows, width), dtype=np.float32)
    run = driver(weight.fmt)
    for r in range(0, inputs.rows, ROW_CHUNK):
        e = min(r + ROW_CHUNK, inputs.rows)
        part = out if (r == 0 and e == inputs.rows) else np.empty((e - r, width), dtype=np.float32)
        run(*weight.arrays, np.ascontiguousarray(inputs.xw[:, r:e]),
            np.ascontiguousarray(inputs.dx[:, r:e]), np.ascontiguousarray(inputs.sx[:, r:e]),
            np.ascontiguousarray(inputs.xs[:, r:e]), part)
        if part is not out:
            out[r:e] = part
    return out


def linear(x: np.ndarray, weight: Packed) -> np.ndarray:
    """x [M, K] @ W.T -> [M, N] float32 (W a Packed weight)."""
    return qmatmul(Inputs(x), weight)[:, : weight.n]


fix_module(globals())
