"""LLVM-IR pieces the quantized engine's kernels share (kernel.py, arch/*.py, attention.py)."""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...numba_cache import configure as configure_numba_cache
from ...numba_cache import fix_module

configure_numba_cache()

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def fma(builder: ir.IRBuilder, lanes: int = 16) -> Any:
    """llvm.fma on `lanes` float32 lanes, declared in the builder's module."""
    vec = ir.VectorType(F32, lanes)
    return builder.module.declare_intrinsic(f"llvm.fma.v{lanes}f32", fnty=ir.FunctionType(vec, [vec] * 3))


def load_halves(builder: ir.IRBuilder, base: Any, index: Any) -> Any:
    """The sixteen float16 values (their bits: uint16) at base[index] as sixteen float32 lanes
    (vcvtph2ps where the CPU has F16C: every x86 CPU with AVX2)."""
    v16i16, v16f16 = ir.VectorType(I16, 16), ir.VectorType(ir.HalfType(), 16)
    bits = builder.load(builder.bitcast(builder.gep(base, [index]), v16i16.as_pointer()), align=2)
    return builder.fpext(builder.bitcast(bits, v16f16), ir.VectorType(F32, 16))


def loop_back(builder: ir.IRBuilder, counter: Any, step: Any, limit: Any, body: Any, exit_block: Any,
              carried: Any = ()) -> None:
    """Close a counted loop at the end of its body: counter + step and each (phi, value) of
    `carried` fed back, on to `body` while the counter is below `limit`, else to `exit_block`,
    where the builder is left."""
    after = builder.add(counter, step)
    counter.add_incoming(after, builder.block)
    for phi, value in carried:
        phi.add_incoming(value, builder.block)
    builder.cbranch(builder.icmp_signed("<", after, limit), body, exit_block)
    builder.position_at_end(exit_block)


def counted(builder: ir.IRBuilder, start: Any, limit: Any, step: int, init: list[Any], body: Any) -> list[Any]:
    """IR of `for i in range(start, limit, step): carried = body(i, carried)`; the carried values after."""
    entry = builder.block
    loop, done = builder.append_basic_block("loop"), builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed("<", start, limit), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    i.add_incoming(start, entry)
    carried = [builder.phi(v.type) for v in init]
    for phi, v in zip(carried, init):
        phi.add_incoming(v, entry)
    new = body(i, carried)
    latch = builder.block
    loop_back(builder, i, ir.Constant(I64, step), limit, loop, done, zip(carried, new))
    final = [builder.phi(v.type) for v in init]
    for phi, a, b in zip(final, init, new):
        phi.add_incoming(a, entry)
        phi.add_incoming(b, latch)
    return final


def prefetch(builder: ir.IRBuilder, address: Any) -> None:
    """Ask for the cache line at `address` (any pointer; past an array's end is harmless: a
    prefetch never faults) to be brought into L1 for reading."""
    byte_ptr = I8.as_pointer()
    fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr, I32, I32, I32]))
    builder.call(fn, [builder.bitcast(address, byte_ptr), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def splat(builder: ir.IRBuilder, value: Any, vec: ir.VectorType) -> Any:
    """`value` in every lane of `vec`."""
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, vec.count), [0] * vec.count))


@intrinsic
def to_half(typingctx, x):  # pragma: no cover - compiled
    """A float32's nearest float16 (ties to even), as its bits (uint16): how the quantized engine
    keeps keys and values (numba has no float16 on the CPU)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_bits(typingctx, x):  # pragma: no cover - compiled
    """A float32's bits as a uint32 (how int8 keys keep their scales beside them)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


fix_module(globals())
