"""Several requests in one pass on the quantized engine against one pass each (issue 46's engine side).

    .venv/bin/python examples/batch_pass_bench.py [--model FILE.gguf] [--context 600] [--json]

For B requests, each with `--context` cached tokens, one pass over every request's n tokens
(core.model.sessions.score_batch) against B passes one after another, the median of --repeats
runs each, in one sitting; the same logits either way (tests/test_quantized.py).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from specx.core.draft import Draft
from specx.core.model import cpu
from specx.core.model.load import builtin_gguf
from specx.core.model.quantized.engine import QuantEngine
from specx.core.model.sessions import score_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file (default: the built-in model)")
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--tokens", default="1,4", help="tokens per request per pass (1 pending + a linear draft)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    engine = QuantEngine(args.model or builtin_gguf("smollm2-135m"))
    rng = np.random.default_rng(0)
    rows = []
    for batch in map(int, args.batches.split(",")):
        for n in map(int, args.tokens.split(",")):
            sessions = [engine.start(rng.integers(100, 1000, args.context).tolist()) for _ in range(batch)]
            draft = Draft(rng.integers(100, 1000, n - 1).tolist(), list(range(-1, n - 2)), [0.5] * (n - 1), 1.0, 1)
            together, apart = [], []
            for _ in range(args.repeats + 1):  # the first of each warms up
                t0 = time.perf_counter()
                score_batch(sessions, [[5]] * batch, [draft] * batch)
                together.append(time.perf_counter() - t0)
                for s in sessions:
                    s.keep_path([])
                t0 = time.perf_counter()
                for s in sessions:
                    s.score([5], draft)
                    s.keep_path([])
                apart.append(time.perf_counter() - t0)
            one, each = float(np.median(together[1:])) * 1e3, float(np.median(apart[1:])) * 1e3
            rows.append({"requests": batch, "tokens_each": n, "batched_ms": round(one, 2), "separate_ms": round(each, 2),
                         "gain": round(each / one, 2)})
    if args.json:
        print(json.dumps({"cpu": cpu.model_name(), "model": str(engine.path), "context": args.context, "rows": rows},
                         indent=1))
        return
    print(f"{cpu.model_name()}, {engine.path.name}, {args.context} cached tokens per request")
    print(f"{'requests':>9}{'tokens each':>13}{'one pass ms':>13}{'separate ms':>13}{'gain':>7}")
    for r in rows:
        print(f"{r['requests']:>9}{r['tokens_each']:>13}{r['batched_ms']:>13.1f}{r['separate_ms']:>13.1f}{r['gain']:>6.2f}x")


if __name__ == "__main__":
    main()
