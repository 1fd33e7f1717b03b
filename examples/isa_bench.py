"""The quantized engine's passes per instruction-set family, beside llama.cpp built for the same ones.

    python examples/isa_bench.py --families avx512vnni,avx2 --llama-bench avx2=/path/llama-bench --json out.json

For each family, a child process compiles the engine for it (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES:
an AVX2 build of the kernels runs on any AVX2 machine, so one AVX-512 machine times every family
it can execute) and times on the model (default: the built-in GGUF):

- one pass of 1, 2, 4, 8, 16 tokens after `--context` cached tokens (the median of `--repeats`),
- the prefill of a `--prompt`-token prompt, ms per token (64-token passes, as the engine prefills).

`--llama-bench FAMILY=PATH` runs that llama-bench (built with the family's instruction sets: `-DGGML_AVX512=OFF`
and the rest for AVX2) on the same file in the same sitting: `-p 512 -n 0` for the prompt and
`-p K -d CONTEXT` for a K-token pass after CONTEXT cached tokens. Prints a table (stderr: progress)
and, with --json, writes every figure. Families the CPU cannot execute are skipped (said so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)


def say(message: str) -> None:
    print(f"isa_bench: {message}", file=sys.stderr, flush=True)


def child(model: str, context: int, prompt: int, repeats: int) -> dict:
    """Runs in the child: the engine compiled for this process's numba target, timed."""
    import numpy as np

    from specx.core.model.quantized import target
    from specx.core.model.quantized.engine import KVCache, QuantEngine
    from specx.core.model.sessions import prefill

    started = time.perf_counter()
    engine = QuantEngine(model)
    load_s = time.perf_counter() - started
    model_ = engine.model
    rng = np.random.default_rng(0)
    vocab = model_.config.vocab
    tokens = [int(t) for t in rng.integers(10, min(vocab, 40000), size=max(context, prompt) + 64)]
    base = KVCache(model_.config, context + 32)
    prefill(model_, base, tokens[:context])
    passes = {}
    for size in SIZES:
        times = []
        for _ in range(repeats):
            kv = base.copy(context)
            new = tokens[context : context + size]
            allowed = np.tril(np.ones((size, size), dtype=np.uint8))
            t0 = time.perf_counter()
            model_.forward(kv, new, np.arange(context, context + size), allowed, np.arange(size))
            times.append(time.perf_counter() - t0)
        passes[str(size)] = 1000 * statistics.median(times)
    times = []
    for _ in range(max(1, repeats // 2)):
        kv = KVCache(model_.config, prompt + 16)
        t0 = time.perf_counter()
        prefill(model_, kv, tokens[:prompt])
        times.append(time.perf_counter() - t0)
    return {"family": target.isa(), "load_s": load_s, "pass_ms": passes,
            "prefill_ms_per_token": 1000 * statistics.median(times) / prompt,
            "weight_bytes": model_.weight_bytes, "multiply_adds": model_.multiply_adds}


def cpu_name(family: str) -> str:
    """What numba is told to compile for `family`: the host where it is the host's family, else the
    first CPU the family's file names (with no AVX-512 where the family has none), else plain x86-64."""
    from specx.core.model.quantized import arch, target

    if arch.family(target.host_features()) == family:
        return "host"
    return next(iter(arch.FAMILIES[family].CPUS), "x86-64")


def run_family(family: str, args: argparse.Namespace) -> dict | None:
    from specx.core.model.quantized import target

    if not target.runs_here(family):
        say(f"{family}: this CPU does not execute it: skipped")
        return None
    name = cpu_name(family)
    env = {**os.environ, "NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": ""}
    if name == "host":
        env.pop("NUMBA_CPU_NAME")
        env.pop("NUMBA_CPU_FEATURES")
    say(f"{family}: timing the quantized engine compiled for {name}")
    done = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--context", str(args.context),
                           "--prompt", str(args.prompt), "--repeats", str(args.repeats)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        say(f"{family}: the child failed:\n{done.stderr[-3000:]}")
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["family"] != family:
        say(f"{family}: numba compiled {result['family']} instead")
    return result


def llama_bench(path: str, model: str, context: int, prompt: int, repeats: int) -> dict:
    def bench(*extra: str) -> float:
        out = subprocess.run([path, "-m", model, "-t", str(os.cpu_count() or 2), "-r", str(repeats), "-o", "json",
                              *extra], capture_output=True, text=True, check=True).stdout
        row = json.loads(out)[0]
        return row["avg_ns"] / 1e6  # ms for the whole test

    say(f"llama-bench {path}")
    passes = {str(k): bench("-p", str(k), "-n", "0", "-d", str(context)) for k in SIZES}
    return {"pass_ms": passes, "prefill_ms_per_token": bench("-p", str(prompt), "-n", "0") / prompt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python examples/isa_bench.py --families avx2 "
                                            "--llama-bench avx2=~/llama-avx2/bin/llama-bench")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the built-in model's)")
    parser.add_argument("--families", default="avx512vnni,avxvnni,avx2")
    parser.add_argument("--llama-bench", action="append", default=[], help="FAMILY=PATH of a llama-bench built for it")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from specx.core.model.load import DEFAULT_MODEL, builtin_gguf

        args.model = str(builtin_gguf(DEFAULT_MODEL))
    if args.child:
        print(json.dumps(child(args.model, args.context, args.prompt, args.repeats)))
        return
    from specx.core.model import cpu

    benches = dict(item.split("=", 1) for item in args.llama_bench)
    rows = []
    for family in args.families.split(","):
        mine = run_family(family, args)
        if mine:
            rows.append({"engine": "quantized", **mine})
        if family in benches:
            rows.append({"engine": "llama.cpp", "family": family,
                         **llama_bench(benches[family], args.model, args.context, args.prompt, args.repeats)})
    header = ["engine", "family", *[f"{k} tok ms" for k in SIZES], "4/1", "prefill ms/tok"]
    print(" | ".join(header))
    for r in rows:
        p = r["pass_ms"]
        print(" | ".join([r["engine"], r["family"], *[f"{p[str(k)]:.1f}" for k in SIZES], f"{p['4'] / p['1']:.2f}",
                          f"{r['prefill_ms_per_token']:.2f}"]))
    doc = {"cpu": cpu.model_name(), "instruction_sets": cpu.instruction_sets(), "model": args.model,
           "context": args.context, "prompt": args.prompt, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
