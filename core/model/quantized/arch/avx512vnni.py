"""AVX-512 VNNI (Intel since Ice Lake and Cascade Lake, AMD since Zen 4): vpdpbusd on zmm, sixteen
outputs a register, four u8 x s8 products summed into each int32 lane in one instruction."""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from ..ir import I32
from ..quant import Format

NAME = "AVX-512 VNNI"
LANES = 16


class Dots:
    offset_done = False

    def __init__(self, builder: ir.IRBuilder, fmt: Format, lanes: int = LANES) -> None:
        self.b = builder
        self.vi32 = ir.VectorType(I32, lanes)
        self.dpbusd = builder.module.declare_intrinsic(f"llvm.x86.avx512.vpdpbusd.{32 * lanes}",
                                                       fnty=ir.FunctionType(self.vi32, [self.vi32] * 3))

    def prepare(self, weights: list[Any]) -> list[Any]:
        return weights

    def dot(self, weights: list[Any], xs: list[Any]) -> Any:
        acc = ir.Constant(self.vi32, None)
        for w, x in zip(weights, xs):
            acc = self.b.call(self.dpbusd, [acc, w, x])
        return acc
