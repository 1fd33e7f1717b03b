"""AVX-512 VNNI (Intel since Ice Lake and Cascade Lake, AMD since Zen 4): vpdpbusd on zmm, sixteen
outputs a register, four u8 x s8 products summed into each int32 lane in one instruction."""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from ..ir import I32
from ..quant import Format

NAME = "AVX-512 VNNI"
LANES = 16
PRIORITY = 3  # the most preferred: a whole panel a register
REQUIRES = frozenset({"avx512vnni"})  # vpdpbusd zmm (LLVM's avx512vnni implies avx512f)
_BF16 = frozenset({"avx512bf16"})  # values.py's vdpbf16ps
# LLVM CPU names (NUMBA_CPU_NAME without NUMBA_CPU_FEATURES) this family is chosen for, each with the
# features beyond REQUIRES the kernels ask about
CPUS = {**dict.fromkeys(("icelake-client", "icelake-server", "tigerlake", "rocketlake", "cascadelake"), frozenset()),
        **dict.fromkeys(("cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"), _BF16)}


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
