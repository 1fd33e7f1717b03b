"""AVX-VNNI (Intel since Alder Lake and Sapphire Rapids, AMD Zen 5): vpdpbusd on ymm (VEX), eight
outputs a register, half a panel per tile; the same instruction as avx512vnni's on 256 bits."""

from __future__ import annotations

from llvmlite import ir

from ..quant import Format
from .avx512vnni import Dots as Dots512

NAME = "AVX-VNNI"
LANES = 8
PRIORITY = 2
# the VEX vpdpbusd needs the AVX-VNNI bit itself: AVX512-VNNI alone (AMD Zen 4) does not run it (SIGILL)
REQUIRES = frozenset({"avxvnni"})
# LLVM CPU names (NUMBA_CPU_NAME without NUMBA_CPU_FEATURES) this family is chosen for (Sapphire Rapids
# and Zen 5 have AVX-VNNI too, but avx512vnni ranks higher and lists them)
CPUS = dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake", "gracemont", "sierraforest"), frozenset())


class Dots(Dots512):
    def __init__(self, builder: ir.IRBuilder, fmt: Format, lanes: int = LANES) -> None:
        super().__init__(builder, fmt, lanes)
