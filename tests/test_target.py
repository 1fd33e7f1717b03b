"""The CPU the quantized kernels compile for (core/model/quantized/target.py) and the families'
own requirements (core/model/quantized/arch/): the same family on every CPU as when kernel.py held a
hand list of CPU names, and the relation to core/model/cpu.py's /proc/cpuinfo spelling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specx.core.model import cpu
from specx.core.model.quantized import arch, target
from specx.core.model.quantized.arch import FAMILIES, family

# what kernel.py chose before the families declared their requirements (its family() and _NAMED_CPUS)
BEFORE = [
    ((), "generic"), (("sse4.2", "avx", "fma"), "generic"), (("avx2",), "avx2"), (("avx2", "avxvnni"), "avxvnni"),
    (("avxvnni",), "avxvnni"), (("avx512vnni",), "avx512vnni"), (("avx512f", "avx512vl", "avx2"), "avx2"),
    (("avx512f", "avx512vl", "avx512vnni", "avx2"), "avx512vnni"), (("avx512bf16", "avx2"), "avx2"),
    (("avx512vnni", "avxvnni", "avx2", "avx512bf16"), "avx512vnni"),
]
NAMED_BEFORE = {
    **dict.fromkeys(("haswell", "broadwell", "skylake", "skylake-avx512", "znver1", "znver2", "znver3"), "avx2"),
    **dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake", "gracemont", "sierraforest"), "avxvnni"),
    **dict.fromkeys(("icelake-client", "icelake-server", "tigerlake", "rocketlake", "cascadelake", "cooperlake",
                     "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"), "avx512vnni"),
    "x86-64": "generic", "nehalem": "generic",  # names no family lists
}
BF16_BEFORE = {"cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"}


@pytest.mark.parametrize("features, want", BEFORE, ids=lambda v: ",".join(v) if isinstance(v, tuple) else v)
def test_a_feature_set_gets_the_family_it_got_before(features, want):
    assert family(frozenset(features)) == want
    spelled = ",".join(f"+{f}" for f in features) or "-avx2"  # as NUMBA_CPU_FEATURES names them
    assert family(target.features_of("host", spelled)) == want


def test_each_named_cpu_gets_the_family_and_bfloat16_it_got_before():
    """NUMBA_CPU_NAME without NUMBA_CPU_FEATURES: the CPU's features as the families' CPUS say."""
    for name, want in NAMED_BEFORE.items():
        features = target.features_of(name, "")
        assert family(features) == want, name
        assert ("avx512bf16" in features) == (name in BF16_BEFORE), name
    listed = [name for module in FAMILIES.values() for name in module.CPUS]
    assert sorted(listed) == sorted(set(listed)) == sorted(n for n, f in NAMED_BEFORE.items() if f != "generic")


def test_numbas_settings_name_the_target_in_a_fresh_process():
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES as the tests set them for compiling every family; neither: the host."""
    host = target.host_features()
    code = ("from specx.core.model.quantized import target\n"
            "print(target.isa(), target.has_bf16(), target.features() == target.features_of('host', ''))")
    runs = {("alderlake", ""): "avxvnni False False", ("znver4", ""): "avx512vnni True False",
            ("host", "+avx2,+avx512bf16"): "avx2 True False", None: f"{family(host)} {'avx512bf16' in host} True"}
    for setting, want in runs.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
        if setting:
            env |= {"NUMBA_CPU_NAME": setting[0], "NUMBA_CPU_FEATURES": setting[1]}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.stdout.strip() == want, (setting, done.stderr[-2000:])


def test_the_families_are_the_files_of_arch_most_preferred_first():
    """A new family is one new file: every file is found, each declares the same names."""
    files = {p.stem for p in Path(arch.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert set(FAMILIES) == files
    priorities = [module.PRIORITY for module in FAMILIES.values()]
    assert priorities == sorted(set(priorities), reverse=True)
    for module in FAMILIES.values():
        assert {"NAME", "LANES", "PRIORITY", "REQUIRES", "CPUS", "Dots"} <= set(vars(module))
    assert not list(FAMILIES.values())[-1].REQUIRES  # the last resort runs anywhere
    # the family chosen for this host is one it runs, and so is the last resort
    assert target.runs_here(family(target.host_features())) and target.runs_here(list(FAMILIES)[-1])


def test_every_feature_the_kernels_ask_about_has_a_cpuinfo_name_and_both_readings_agree():
    """cpu.py's LLVM_NAMES maps /proc/cpuinfo's spelling to LLVM's: it names every feature a family
    requires or a named CPU adds, and on this machine llvmlite and /proc/cpuinfo agree on them."""
    asked = frozenset().union(*(m.REQUIRES.union(*m.CPUS.values()) for m in FAMILIES.values()))
    assert asked <= set(cpu.LLVM_NAMES.values())
    if not cpu.flags():
        pytest.skip("no /proc/cpuinfo flags here")
    from_cpuinfo = {cpu.LLVM_NAMES[flag] for flag in cpu.flags() if flag in cpu.LLVM_NAMES}
    assert from_cpuinfo & asked == target.host_features() & asked
