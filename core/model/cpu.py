"""The CPU specx runs on: its instruction sets, a fingerprint for what is kept per machine, and the
llama.cpp build flags that run on it.

Standard library only, so that set-up runs it before anything is installed:

    python3 core/model/cpu.py --cmake-args   # the CMAKE_ARGS `make setup` builds llama-cpp-python with
    python3 core/model/cpu.py                # the instruction sets, one line

Why a build of our own flags rather than ggml's native one: on Intel Xeons with AMX (Sapphire
Rapids and later) the native build compiles ggml's AMX path, which runs tile instructions on threads
that never asked the kernel for AMX state, and the process dies with SIGILL on its first pass
(llama.cpp's fix is pending upstream). So the build names each instruction set the CPU has (AVX-512,
VNNI, BF16 kept) and leaves AMX out; everything else is what ggml's native detection would pick.
Off x86-64 Linux (ARM, macOS) the native build is right and is kept.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

# ggml option -> the /proc/cpuinfo flag that enables it (ggml/src/ggml-cpu/CMakeLists.txt's x86 options)
GGML_X86 = {
    "GGML_SSE42": "sse4_2",
    "GGML_AVX": "avx",
    "GGML_AVX2": "avx2",
    "GGML_AVX_VNNI": "avx_vnni",
    "GGML_FMA": "fma",
    "GGML_F16C": "f16c",
    "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f",
    "GGML_AVX512_VBMI": "avx512vbmi",
    "GGML_AVX512_VNNI": "avx512_vnni",
    "GGML_AVX512_BF16": "avx512_bf16",
}
# AMX crashes the process (SIGILL in ggml's tile code), so it stays out whatever the CPU has.
GGML_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# The instruction sets worth naming in a report (the rest follow from these): /proc/cpuinfo's name ->
# LLVM's, which numba compiles for and the quantized kernels' families require (REQUIRES in
# core/model/quantized/arch/, asked of llvmlite by core/model/quantized/target.py). The one place the
# two spellings meet: every feature a kernel asks about is here (tests/test_target.py).
LLVM_NAMES = {"avx2": "avx2", "avx512f": "avx512f", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
              "avx_vnni": "avxvnni", "amx_tile": "amx-tile", "amx_int8": "amx-int8", "amx_bf16": "amx-bf16"}
NAMED = tuple(LLVM_NAMES)


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo, read once per process ("" where there is none): it does not change under us."""
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo; empty where there is none).

    >>> sorted(flags("processor : 0\\nflags : fpu avx2 fma\\n"))
    ['avx2', 'fma', 'fpu']
    """
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def model_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Processor"), else what `platform` says."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def instruction_sets(cpu_flags: frozenset[str] | None = None) -> list[str]:
    """The instruction sets of NAMED this CPU has, in NAMED's order.

    >>> instruction_sets(frozenset({"avx2", "fma", "amx_tile"}))
    ['avx2', 'amx_tile']
    """
    have = flags() if cpu_flags is None else cpu_flags
    return [name for name in NAMED if name in have]


def fingerprint() -> dict[str, object]:
    """What names this machine in a file kept per machine: model, cores, instruction sets, platform."""
    return {"cpu": model_name(), "cpus": os.cpu_count(), "isa": instruction_sets(),
            "platform": platform.platform()}


def llama_cmake_args(cpu_flags: frozenset[str] | None = None, machine: str | None = None,
                     system: str | None = None) -> str:
    """The CMAKE_ARGS that build llama.cpp to run on this CPU: ggml's native build off x86-64 Linux,
    else every listed instruction set the CPU has, AMX never.

    >>> llama_cmake_args(frozenset({"avx", "avx2", "fma"}), "x86_64", "Linux").split()[:4]
    ['-DGGML_NATIVE=OFF', '-DGGML_SSE42=OFF', '-DGGML_AVX=ON', '-DGGML_AVX2=ON']
    >>> llama_cmake_args(frozenset(), "aarch64", "Linux")
    '-DGGML_NATIVE=ON'
    """
    machine = platform.machine() if machine is None else machine
    system = platform.system() if system is None else system
    if machine.lower() not in ("x86_64", "amd64") or system != "Linux":
        return "-DGGML_NATIVE=ON"
    have = flags() if cpu_flags is None else cpu_flags
    args = ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in have else 'OFF'}"
                                     for option, flag in GGML_X86.items()]
    return " ".join(args + [f"-D{option}=OFF" for option in GGML_OFF])


def build_key(cmake_args: str) -> str:
    """A short name for a build made with `cmake_args` (the wheel folder `make setup` keeps it in)."""
    return hashlib.sha256(cmake_args.encode()).hexdigest()[:12]


if __name__ == "__main__":
    if sys.argv[1:] == ["--cmake-args"]:
        print(llama_cmake_args())
    elif sys.argv[1:] == ["--build-key"]:
        print(build_key(llama_cmake_args()))
    else:
        print(f"{model_name()}: {' '.join(instruction_sets()) or 'no AVX2'}")
