"""The quantized kernel's instruction-set families, one file each (ggml's ggml-cpu/arch/x86 layout):
every module holds the same names, which core/model/quantized/kernel.py builds its tile from:

    NAME         how a report names it
    LANES        outputs a vector register holds (16 in 512 bits, 8 in 256)
    Dots(builder, fmt)
        .offset_done   True where `dot` already gives sum (q - offset) x (no correction after)
        .prepare(w)    per-block work on a block's weight vectors, shared by every row
        .dot(w, xs)    <LANES x i32>: sum over a sub-block's groups of u8(w_g) x s8(x_g), four
                       inputs a lane, xs the row's input words broadcast

Every family's integer sums are exact (none can overflow) and the float steps around them are
the kernel's, the same for all: every family gives the same bits (tests/test_quantized.py).
An Arm port adds a file here: NEON's udot/sdot (4 x u8/s8 -> s32 per lane) is avxvnni's dot on
128-bit registers, and without the dot-product extension umull/sadalp play avx2's maddubs/madd.
"""

from __future__ import annotations

from types import ModuleType

from . import avx2, avx512vnni, avxvnni, generic

FAMILIES: dict[str, ModuleType] = {"avx512vnni": avx512vnni, "avxvnni": avxvnni, "avx2": avx2, "generic": generic}
