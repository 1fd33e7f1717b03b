"""**Quantized linear layers**: x [M, K] @ W.T for a GGUF weight kept in its own bits (core/model/quant.py).

The activations are quantized per row, in blocks of 32 inputs, to int8 with a float scale (as
llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d)); a block's dot product with a weight block
is then exact integer arithmetic, scaled once:

    out[m, n] += s[n] * dx[m] * (sum_k q_w[n, k] q_x[m, k] - o * sum_k q_x[m, k]) + min[n] * dx[m] * sum_k q_x[m, k]

A micro-kernel (LLVM IR, like core/model/matmul.py's) holds sixteen outputs (a panel) of 1, 2, 4
or 8 rows in vector registers for the whole of K: per 32 inputs it loads the panel's weights
once (4 or 8 loads of 64 bytes; 4-bit values unpacked with two ands and a shift), and for each
row runs vpdpbusd (u8 x s8 -> int32, four inputs per lane) against that row's inputs broadcast,
then one conversion and two multiply-adds. So a pass reads each weight once from memory whatever
the rows; extra rows cost only their arithmetic. Without AVX-512 VNNI the same arithmetic runs as
generic LLVM vector code (AVX2: pmaddwd), same results.

Batch-invariant: a row's outputs are one fixed sequence of exact integer sums and float
multiply-adds over K in order, whatever rows are beside it, however the rows are grouped and
whichever thread runs the panel; a row's quantization depends on that row alone.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ..numba_cache import configure as configure_numba_cache
from .quant import BLOCK, PANEL, Format, Packed

configure_numba_cache()  # before any kernel here is decorated

ROW_CHUNK = 64  # rows per kernel call: a chunk's quantized inputs stay in L2 while the panels stream
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I32, _V16F32 = ir.VectorType(_I32, PANEL), ir.VectorType(_F32, PANEL)


@functools.lru_cache(maxsize=None)
def vnni() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (NUMBA_CPU_NAME/FEATURES can say no)."""
    from numba.core import config
    from llvmlite import binding

    if config.CPU_NAME and config.CPU_NAME != "host":
        features = config.CPU_FEATURES or ""
        return "+avx512vnni" in features.split(",")
    if config.CPU_FEATURES:
        return "+avx512vnni" in config.CPU_FEATURES.split(",")
    return bool(binding.get_host_cpu_features().get("avx512vnni", False))


def fma16(builder: ir.IRBuilder) -> Any:
    """llvm.fma on sixteen float32 lanes, declared in the builder's module (every kernel here and
    core/model/qattention.py's)."""
    return builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(_V16F32, [_V16F32] * 3))


def load_halves(builder: ir.IRBuilder, base: Any, index: Any) -> Any:
    """The sixteen float16 values (their bits: uint16) at base[index] as sixteen float32 lanes
    (vcvtph2ps where the CPU has F16C: every x86 CPU with AVX2)."""
    v16i16, v16f16 = ir.VectorType(_I16, 16), ir.VectorType(ir.HalfType(), 16)
    bits = builder.load(builder.bitcast(builder.gep(base, [index]), v16i16.as_pointer()), align=2)
    return builder.fpext(builder.bitcast(bits, v16f16), _V16F32)


@intrinsic
def to_half(typingctx, x):  # pragma: no cover - compiled
    """A float32's nearest float16 (ties to even), as its bits (uint16): how the quantized engine
    keeps keys and values (numba has no float16 on the CPU)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)

    return types.uint16(types.float32), codegen


def splat(builder: ir.IRBuilder, value: Any, vec: ir.VectorType) -> Any:
    """`value` in every lane of `vec`."""
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(ir.VectorType(_I32, vec.count),
                                                                                 [0] * vec.count))


def _dot4_generic(builder: ir.IRBuilder, acc: Any, w: Any, x: Any) -> Any:
    """acc[i] + sum_j<4 u8(w)[4i + j] * s8(x)[4i + j] in plain vector IR (vpdpbusd's arithmetic):
    products fit int16, pairs are summed as pmaddwd does, then pairs of pairs."""
    v64i8, v64i16, v32i32 = ir.VectorType(_I8, 64), ir.VectorType(_I16, 64), ir.VectorType(_I32, 32)
    a = builder.zext(builder.bitcast(w, v64i8), v64i16)
    b = builder.sext(builder.bitcast(x, v64i8), v64i16)
    undef = ir.Constant(v64i16, ir.Undefined)
    pick = lambda v, start: builder.shuffle_vector(  # noqa: E731
        v, undef, ir.Constant(ir.VectorType(_I32, 32), list(range(start, 64, 2))))
    pairs = builder.add(builder.mul(builder.sext(pick(a, 0), v32i32), builder.sext(pick(b, 0), v32i32)),
                        builder.mul(builder.sext(pick(a, 1), v32i32), builder.sext(pick(b, 1), v32i32)))
    undef32 = ir.Constant(v32i32, ir.Undefined)
    even = builder.shuffle_vector(pairs, undef32, ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2))))
    odd = builder.shuffle_vector(pairs, undef32, ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2))))
    return builder.add(acc, builder.add(even, odd))


def _tile(rows: int, fmt: Format, use_vnni: bool) -> Any:
    """An LLVM-IR micro-kernel: out[r0 + m, 16 p : 16 p + 16] = the rows r0..r0+rows-1 of the
    quantized inputs against panel p of a Packed weight of format `fmt`, over all of K."""
    groups_per_sub = fmt.sub // 4  # groups of four inputs per scale
    subs = BLOCK // fmt.sub  # scales per block of 32

    @intrinsic
    def tile(typingctx, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, p, r0):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            arrs = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:10], args[:10])]
            vd, sd, md, kdd, kmd, xwd, dxd, sxd, xsd, od = (a.data for a in arrs)
            p_, r0_ = args[10], args[11]
            nb = builder.extract_value(arrs[0].shape, 1)  # blocks of 32 along K
            m_dim = builder.extract_value(arrs[5].shape, 1)  # rows of the quantized inputs
            n_out = builder.extract_value(arrs[9].shape, 1)
            const = lambda v: ir.Constant(_I64, v)  # noqa: E731
            fma = fma16(builder)
            if use_vnni:
                dpbusd = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512",
                                                          fnty=ir.FunctionType(_V16I32, [_V16I32] * 3))
                dot4 = lambda acc, w, x: builder.call(dpbusd, [acc, w, x])  # noqa: E731
            else:
                dot4 = lambda acc, w, x: _dot4_generic(builder, acc, w, x)  # noqa: E731
            vec_at = lambda ptr, idx, vec: builder.load(  # noqa: E731
                builder.bitcast(builder.gep(ptr, [idx]), vec.as_pointer()), align=1)
            v16i8, v16i16 = ir.VectorType(_I8, PANEL), ir.VectorType(_I16, PANEL)
            v16half = ir.VectorType(ir.HalfType(), PANEL)

            def f16_vector(ptr: Any, index: Any) -> Any:  # 16 float16 at byte 32 * index
                raw = vec_at(ptr, builder.mul(index, const(32)), v16i16)
                return builder.fpext(builder.bitcast(raw, v16half), _V16F32)

            def k_vector(ptr: Any, index: Any, signed: bool, d: Any) -> Any:  # 16 integers at byte 16 * index, times d
                raw = vec_at(ptr, builder.mul(index, const(16)), v16i8)
                wide = builder.sext(raw, _V16I32) if signed else builder.zext(raw, _V16I32)
                return builder.fmul(d, builder.sitofp(wide, _V16F32))

            row = [builder.add(r0_, const(m)) for m in range(rows)]
            entry, loop, done = builder.block, builder.append_basic_block("loop"), builder.append_basic_block("done")
            builder.branch(loop)
            builder.position_at_end(loop)
            b = builder.phi(_I64)
            b.add_incoming(const(0), entry)
            acc = [builder.phi(_V16F32) for _ in range(rows)]
            for a in acc:
                a.add_incoming(ir.Constant(_V16F32, None), entry)
            pb = builder.add(builder.mul(p_, nb), b)  # (panel, block) index
            base = builder.mul(pb, const(fmt.block_bytes))
            weights: list[Any] = [None] * 8  # 8 groups of four inputs for sixteen outputs, <16 x i32>
            if fmt.bits == 8:
                for g in range(8):
                    weights[g] = vec_at(vd, builder.add(base, const(64 * g)), _V16I32)
            else:
                low = ir.Constant(_V16I32, [0x0F0F0F0F] * PANEL)
                for t in range(4):
                    both = vec_at(vd, builder.add(base, const(64 * t)), _V16I32)
                    weights[t] = builder.and_(both, low)
                    weights[t + 4] = builder.and_(builder.lshr(both, ir.Constant(_V16I32, [4] * PANEL)), low)
                if fmt.bits == 6:
                    two = ir.Constant(_V16I32, [0x03030303] * PANEL)
                    for u in range(2):
                        high = vec_at(vd, builder.add(base, const(256 + 64 * u)), _V16I32)
                        for i in range(4):
                            bits = builder.and_(builder.lshr(high, ir.Constant(_V16I32, [2 * i] * PANEL)), two)
                            weights[4 * u + i] = builder.or_(weights[4 * u + i],
                                                             builder.shl(bits, ir.Constant(_V16I32, [4] * PANEL)))
            d256 = dmin256 = None
            if fmt.scale == "k":  # the 256-block's float32 d (and dmin) for sixteen outputs
                k256 = builder.add(builder.mul(p_, builder.udiv(nb, const(8))), builder.udiv(b, const(8)))
                d256 = vec_at(kdd, builder.mul(k256, const(PANEL)), _V16F32)
                if fmt.has_min:
                    dmin256 = vec_at(kmd, builder.mul(k256, const(PANEL)), _V16F32)
            new = list(acc)
            zero = ir.Constant(_V16I32, None)
            for s in range(subs):
                sub = builder.add(builder.mul(pb, const(subs)), const(s))  # (panel, sub-block) index
                scale = (f16_vector(sd, sub) if fmt.scale == "f16" else k_vector(sd, sub, fmt.signed, d256))
                for m in range(rows):
                    dot = zero
                    for g in range(s * groups_per_sub, (s + 1) * groups_per_sub):
                        xg = builder.load(builder.gep(xwd, [builder.add(builder.mul(builder.add(
                            builder.mul(b, const(8)), const(g)), m_dim), row[m])]))
                        dot = dot4(dot, weights[g], splat(builder, xg, _V16I32))
                    if fmt.offset:
                        # sums of the row's quantized inputs per 16: sx[2 b + h] for the halves in this sub-block
                        total = None
                        for h in ((s,) if fmt.sub == 16 else (0, 1)):
                            idx = builder.add(builder.mul(builder.add(builder.mul(b, const(2)), const(h)), m_dim), row[m])
                            v = builder.load(builder.gep(sxd, [idx]))
                            total = v if total is None else builder.add(total, v)
                        dot = builder.sub(dot, splat(builder, builder.mul(total, ir.Constant(_I32, fmt.offset)),
                                                      _V16I32))
                    d_row = builder.load(builder.gep(dxd, [builder.add(builder.mul(b, m_dim), row[m])]))
                    scaled = builder.fmul(scale, splat(builder, d_row, _V16F32))
                    new[m] = builder.call(fma, [builder.sitofp(dot, _V16F32), scaled, new[m]])
            if fmt.has_min:
                mins_v = (f16_vector(md, pb) if fmt.scale == "f16"
                          else builder.fneg(k_vector(md, pb, False, dmin256)))
                for m in range(rows):
                    xs_row = builder.load(builder.gep(xsd, [builder.add(builder.mul(b, m_dim), row[m])]))
                    new[m] = builder.call(fma, [mins_v, splat(builder, xs_row, _V16F32), new[m]])
            b_next = builder.add(b, const(1))
            b.add_incoming(b_next, builder.block)
            for a, v in zip(acc, new):
                a.add_incoming(v, builder.block)
            builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)
            builder.position_at_end(done)
            for m in range(rows):
                at = builder.add(builder.mul(row[m], n_out), builder.mul(p_, const(PANEL)))
                builder.store(new[m], builder.bitcast(builder.gep(od, [at]), _V16F32.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, p, r0), codegen

    return tile


def _driver(fmt: Format, use_vnni: bool) -> Any:
    t8, t4, t2, t1 = (_tile(r, fmt, use_vnni) for r in (8, 4, 2, 1))

    @njit(parallel=True, nogil=True)
    def run(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out):  # pragma: no cover - compiled
        rows = xw.shape[1]
        for p in prange(values.shape[0]):  # panels, split between the threads
            pp = np.int64(p)
            r = 0
            while r + 8 <= rows:
                t8(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r))
                r += 8
            if r + 4 <= rows:
                t4(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r))
                r += 4
            if r + 2 <= rows:
                t2(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r))
                r += 2
            if r < rows:
                t1(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out, pp, np.int64(r))

    return run


_DRIVERS: dict[tuple[Format, bool], Any] = {}


def driver(fmt: Format, use_vnni: bool | None = None) -> Any:
    """The compiled kernel for `fmt` (compiled on first use, a few seconds)."""
    key = (fmt, vnni() if use_vnni is None else use_vnni)
    if key not in _DRIVERS:
        _DRIVERS[key] = _driver(*key)
    return _DRIVERS[key]


def any_driver(formats: tuple[Format, ...], use_vnni: bool | None = None) -> Any:
    """run_any(f, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out): the kernel of formats[f], callable
    from compiled code (core/model/qforward.py's layers), where a model's layers mix formats."""
    key = (formats, vnni() if use_vnni is None else use_vnni)
    if key not in _ANY:
        drivers = {f"d{i}": driver(fmt, key[1]) for i, fmt in enumerate(formats)}
        src = "def run_any(f, values, scales, mins, kd, kdmin, xw, dx, sx, xs, out):\n" + "".join(
            f"    {'if' if i == 0 else 'elif'} f == {i}:\n        d{i}(values, scales, mins, kd, kdmin, xw, dx, sx, xs, out)\n"
            for i in range(len(formats)))
        exec(compile(src, "<specx any_driver>", "exec"), drivers)  # noqa: S102 - generated from the format list only
        _ANY[key] = njit(nogil=True)(drivers["run_any"])
    return _ANY[key]


_ANY: dict[tuple[tuple[Format, ...], bool], Any] = {}


@njit(nogil=True, cache=True)
def quantize_rows(x, q8, dx, sx, xs):  # pragma: no cover - compiled
    rows, k = x.shape
    for m in range(rows):
        for b in range(k // 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[m, 32 * b + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if amax > 0 else np.float32(0.0)
            s0, s1 = 0, 0
            for j in range(32):
                v = int(np.rint(x[m, 32 * b + j] * inv))
                v = min(127, max(-127, v))
                q8[8 * b + j // 4, m, j % 4] = v
                if j < 16:
                    s0 += v
                else:
                    s1 += v
            dx[b, m] = d
            sx[2 * b, m] = s0
            sx[2 * b + 1, m] = s1
            xs[b, m] = d * np.float32(s0 + s1)


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
