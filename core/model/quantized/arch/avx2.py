"""AVX2 (every x86 CPU since Haswell and Zen 1: most laptops, AMD before Zen 4, Intel client chips
since Alder Lake): vpmaddubsw (u8 x s8, pairs summed into int16) then vpmaddwd with ones (pairs of
int16 into int32), ggml's AVX2 idiom, eight outputs a ymm register.

vpmaddubsw saturates at 32767, so the int16 sums stop in time: 4-bit weights (<= 15) sum a whole
sub-block of 8 groups in int16 (8 x 2 x 15 x 127 = 30480), 6-bit ones (<= 63) two groups (32004),
8-bit ones one. Q8_0's stored q = w + 128 times 127 would overflow a pair: the sign trick (|w| as
the unsigned operand, x with w's sign: llama.cpp's Q8_0 dot) gives sum w x itself, so the offset
correction is already done (`offset_done`)."""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from ..ir import I8, I16, I32
from ..quant import Format

NAME = "AVX2"
LANES = 8
PRIORITY = 1
REQUIRES = frozenset({"avx2"})
# LLVM CPU names (NUMBA_CPU_NAME without NUMBA_CPU_FEATURES) this family is chosen for
CPUS = dict.fromkeys(("haswell", "broadwell", "skylake", "skylake-avx512", "znver1", "znver2", "znver3"), frozenset())


class Dots:
    def __init__(self, builder: ir.IRBuilder, fmt: Format, lanes: int = LANES) -> None:
        self.b, self.fmt = builder, fmt
        self.vi8, self.vi16 = ir.VectorType(I8, 4 * lanes), ir.VectorType(I16, 2 * lanes)
        vi32 = ir.VectorType(I32, lanes)
        self.offset_done = fmt.bits == 8
        self.maddubs = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw",
                                                        fnty=ir.FunctionType(self.vi16, [self.vi8, self.vi8]))
        self.madd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd",
                                                     fnty=ir.FunctionType(vi32, [self.vi16, self.vi16]))
        self.ones = ir.Constant(self.vi16, [1] * (2 * lanes))
        self.zero8 = ir.Constant(self.vi8, None)

    def prepare(self, weights: list[Any]) -> list[Any]:
        """Q8_0: each weight vector as (|w| u8, w < 0), w = q - 128."""
        if not self.offset_done:
            return weights
        b = self.b
        flip = ir.Constant(self.vi8, [-128] * self.vi8.count)
        out = []
        for w in weights:
            signed = b.xor(b.bitcast(w, self.vi8), flip)
            negative = b.icmp_signed("<", signed, self.zero8)
            out.append((b.select(negative, b.sub(self.zero8, signed), signed), negative))
        return out

    def dot(self, weights: list[Any], xs: list[Any]) -> Any:
        b = self.b
        products = []
        for w, x in zip(weights, xs):
            x8 = b.bitcast(x, self.vi8)
            if self.offset_done:
                magnitude, negative = w
                products.append(b.call(self.maddubs, [magnitude, b.select(negative, b.sub(self.zero8, x8), x8)]))
            else:
                products.append(b.call(self.maddubs, [b.bitcast(w, self.vi8), x8]))
        per = {4: len(products), 6: 2, 8: 1}[self.fmt.bits]  # products summed in int16 before widening
        acc = None
        for i in range(0, len(products), per):
            s16 = products[i]
            for p in products[i + 1 : i + per]:
                s16 = b.add(s16, p)
            wide = b.call(self.madd, [s16, self.ones])
            acc = wide if acc is None else b.add(acc, wide)
        return acc
