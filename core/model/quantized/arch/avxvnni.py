"""AVX-VNNI (Intel since Alder Lake and Sapphire Rapids, AMD Zen 5): vpdpbusd on ymm (VEX), eight
outputs a register, half a panel per tile; the same instruction as avx512vnni's on 256 bits."""

from __future__ import annotations

from llvmlite import ir

from ..quant import Format
from .avx512vnni import Dots as Dots512

NAME = "AVX-VNNI"
LANES = 8


class Dots(Dots512):
    def __init__(self, builder: ir.IRBuilder, fmt: Format, lanes: int = LANES) -> None:
        super().__init__(builder, fmt, lanes)
