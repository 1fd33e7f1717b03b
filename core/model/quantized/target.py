"""**The CPU the quantized kernels compile for**, asked once: the LLVM feature names numba targets.

numba compiles for the host (llvmlite's reading of its CPU) unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES
name another CPU, which is how the tests compile every family on any machine. Every question about
that CPU is put to `features()`: which instruction-set family the kernels take (`isa()`: arch/'s
`family()`, each family's requirements in its own file) and whether the values' kernels sum bfloat16
pairs in one instruction (`has_bf16()`). `runs_here()` asks the host instead, which runs what was
compiled.

The spelling is LLVM's ("avx512vnni", "avxvnni"); core/model/cpu.py reads /proc/cpuinfo's for the
llama.cpp build ("avx512_vnni", "avx_vnni"), and its LLVM_NAMES is the one map between the two.
"""

from __future__ import annotations

import functools

from .arch import FAMILIES, family, named_cpu_features


@functools.cache
def host_features() -> frozenset[str]:
    """The host CPU's LLVM feature names, as llvmlite (and so numba's "host") reads them."""
    from llvmlite import binding

    return frozenset(name for name, on in binding.get_host_cpu_features().items() if on)


def features_of(cpu_name: str, cpu_features: str) -> frozenset[str]:
    """The feature names numba targets for NUMBA_CPU_NAME `cpu_name` and NUMBA_CPU_FEATURES
    `cpu_features`: the features listed ("+avx2,+fma,-avx512f": those with +) where there are any,
    else what the families say the named CPU has, else the host's.

    >>> sorted(features_of("haswell", "+avx2,+avxvnni,-avx512f"))
    ['avx2', 'avxvnni']
    >>> sorted(features_of("sapphirerapids", ""))
    ['avx512bf16', 'avx512vnni']
    """
    if cpu_features:
        return frozenset(f[1:] for f in cpu_features.split(",") if f.startswith("+"))
    if cpu_name and cpu_name != "host":
        return named_cpu_features(cpu_name)
    return host_features()


@functools.cache
def features() -> frozenset[str]:
    """The LLVM feature names numba compiles for in this process (its NUMBA_CPU_* settings are read
    once, at numba's import). Name a CPU with NUMBA_CPU_FEATURES= beside it: where that is unset
    numba keeps the host's features, and the named CPU's family is compiled with them."""
    from numba.core import config

    return features_of(config.CPU_NAME or "", config.CPU_FEATURES or "")


@functools.cache
def isa() -> str:
    """The kernel family numba compiles for (arch/'s FAMILIES)."""
    return family(features())


def has_bf16() -> bool:
    """Whether the CPU numba compiles for has AVX512-BF16 (vdpbf16ps)."""
    return "avx512bf16" in features()


def runs_here(name: str) -> bool:
    """Whether this machine executes family `name`'s instructions (compiling them needs no CPU)."""
    return FAMILIES[name].REQUIRES <= host_features()
