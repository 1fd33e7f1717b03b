"""What a forward pass costs per number of tokens, with and without specx's kernels
(core/model/transformers/kernels.py).

Two tables, side by side in one run on the built-in model:

- **linear layers alone**: the model's 211 weight matrices (cold: together they do not fit in
  cache) times M input rows, by MKL (`torch.nn.functional.linear`, what stock PyTorch runs) and
  by `panel_matmul` (what specx runs from MIN_ROWS to MAX_ROWS rows; MKL otherwise);
- **a whole verification pass** (specx.bench.calibrate: one pending token + a linear draft, cache
  of 128 tokens) on the model with the kernels and on the same weights without them.

Linear layers: the best of `--repeats` runs per size (the machine is noisy; the best is the least
disturbed); passes: the median, as calibrate takes it.

    .venv/bin/python examples/kernel_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specx.home import specx_home
from specx.bench.calibrate import calibrate
from specx.core.model.transformers import matmul
from specx.core.model.load import load_model

ROWS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64)


def time_linears(layers: list[torch.nn.Module], rows: int, repeats: int, stock: bool) -> float:
    """Best seconds of one pass over every layer with `rows` input rows (stock: MKL's linear)."""
    rng = np.random.default_rng(rows)
    inputs = {k: torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
              for k in sorted({m.in_features for m in layers})}
    best = float("inf")
    with torch.inference_mode():
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for m in layers:
                x = inputs[m.in_features]
                if stock:
                    torch.nn.functional.linear(x, m.weight, m.bias)
                else:
                    m(x)
            if r:  # the first run compiles and warms up
                best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=specx_home() / "models", help="model cache ($SPECX_HOME/models)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    net, _ = load_model("smollm2-135m", args.cache)
    if not any("small-batch linear" in k for k in getattr(net, "specx_kernels", [])):
        sys.exit("error: the small-batch kernels are off on this machine (CPU float32 only); nothing to compare")
    stock_net, _ = load_model("smollm2-135m", args.cache, kernels=False)
    layers = [m for m in net.modules() if isinstance(m, matmul.SmallBatchLinear)]
    print(f"timing {len(layers)} linear layers and whole passes at {len(ROWS)} sizes ...", file=sys.stderr)
    linear = {n: {"mkl_ms": 1e3 * time_linears(layers, n, args.repeats, stock=True),
                  "specx_ms": 1e3 * time_linears(layers, n, args.repeats, stock=False)} for n in ROWS}
    passes = {"specx": calibrate(net, ROWS, repeats=args.repeats, long_context=None),
              "stock": calibrate(stock_net, ROWS, repeats=args.repeats, long_context=None)}
    rows = [{"tokens": n, "linear_mkl_ms": linear[n]["mkl_ms"], "linear_specx_ms": linear[n]["specx_ms"],
             "pass_stock_ms": 1e3 * passes["stock"](n), "pass_specx_ms": 1e3 * passes["specx"](n)} for n in ROWS]
    if args.json:
        print(json.dumps({"rows": rows, "kernel_rows": [matmul.MIN_ROWS, matmul.MAX_ROWS],
                          "linear_layers": len(layers), "threads": torch.get_num_threads()}, indent=2))
        return
    print(f"{'tokens':>6} | {'linear: MKL':>12}{'specx':>8} | {'pass: stock':>12}{'specx':>8}   (ms)")
    for r in rows:
        print(f"{r['tokens']:>6} | {r['linear_mkl_ms']:>12.1f}{r['linear_specx_ms']:>8.1f} | "
              f"{r['pass_stock_ms']:>12.1f}{r['pass_specx_ms']:>8.1f}")


if __name__ == "__main__":
    main()
