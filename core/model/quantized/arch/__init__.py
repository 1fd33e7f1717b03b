"""The quantized kernel's instruction-set families, one file each (ggml's ggml-cpu/arch/x86 layout):
every module holds the same names, which core/model/quantized/kernel.py builds its tile from:

    NAME         how a report names it
    LANES        outputs a vector register holds (16 in 512 bits, 8 in 256)
    PRIORITY     the order of preference: of the families a CPU can run, the highest is chosen
    REQUIRES     the LLVM feature names the family's instructions need (frozenset; generic: none)
    CPUS         LLVM CPU names (NUMBA_CPU_NAME without NUMBA_CPU_FEATURES) the family is chosen for,
                 each with the features beyond REQUIRES the kernels ask about (avx512bf16)
    Dots(builder, fmt)
        .offset_done   True where `dot` already gives sum (q - offset) x (no correction after)
        .prepare(w)    per-block work on a block's weight vectors, shared by every row
        .dot(w, xs)    <LANES x i32>: sum over a sub-block's groups of u8(w_g) x s8(x_g), four
                       inputs a lane, xs the row's input words broadcast

The families are found here by listing this package, so a new family is one new file. Which one a
process compiles is core/model/quantized/target.py's `isa()`: `family()` of the features numba
targets.

Every family's integer sums are exact (none can overflow) and the float steps around them are
the kernel's, the same for all: every family gives the same bits (tests/test_quantized.py).
An Arm port adds a file here: NEON's udot/sdot (4 x u8/s8 -> s32 per lane) is avxvnni's dot on
128-bit registers, and without the dot-product extension umull/sadalp play avx2's maddubs/madd.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def _find() -> dict[str, ModuleType]:
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    return {m.__name__.rsplit(".", 1)[1]: m for m in sorted(modules, key=lambda m: -m.PRIORITY)}


FAMILIES: dict[str, ModuleType] = _find()
"""Every family by its file's name, the most preferred first."""


def family(features: set[str] | frozenset[str]) -> str:
    """The most preferred family whose REQUIRES are all among `features` (LLVM feature names).

    >>> family({"avx2", "avxvnni", "fma"}), family({"avx512vnni", "avxvnni", "avx2"}), family({"sse4.2"})
    ('avxvnni', 'avx512vnni', 'generic')
    """
    return next(name for name, module in FAMILIES.items() if module.REQUIRES <= features)


def named_cpu_features(cpu_name: str) -> frozenset[str]:
    """The features the kernels ask about that LLVM CPU `cpu_name` has, as the families' CPUS say
    (none for a name no family lists).

    >>> [sorted(named_cpu_features(name)) for name in ("znver4", "haswell", "x86-64")]
    [['avx512bf16', 'avx512vnni'], ['avx2'], []]
    """
    return frozenset().union(*(module.REQUIRES | module.CPUS[cpu_name]
                               for module in FAMILIES.values() if cpu_name in module.CPUS))
