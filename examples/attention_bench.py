"""The quantized engine's passes at agents' context lengths: one pass over k rows after N cached
tokens, a long prefill against a short one, and the attention alone; optionally beside another
attention.py (an earlier commit's) in the same process, taking turns.

    python examples/attention_bench.py --contexts 600,6000
    git show cecdc26:core/model/quantized/attention.py > /tmp/attention_before.py
    python examples/attention_bench.py --contexts 6000 --compare-attention /tmp/attention_before.py --json

Prints a table per context (ms, median of --repeats) and, with --json, one JSON object. The passes
run on the engine's own session (a random prompt of N tokens; each pass keeps its pending token, so
the cache grows by one a pass); the prefill row is ms per token of 1,000 tokens after N cached
against a 512-token prompt alone; the attention row times one layer's attention alone (its keys and
values random, in cache after the first call) and its float32 arithmetic rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import numpy as np


def load_attention(path: str):  # noqa: ANN201 - a module
    """An attention.py from a file, as a sibling module of the engine's (its relative imports work)."""
    spec = importlib.util.spec_from_file_location("specx.core.model.quantized.attention_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def median_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the built-in model's)")
    parser.add_argument("--contexts", default="600,6000", help="cached tokens, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8,16", help="rows of a pass, comma-separated")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--compare-attention", default=None, help="another attention.py, timed beside this one")
    parser.add_argument("--fill", choices=("prompt", "random"), default="prompt",
                        help="how the cache is filled: a prefilled random prompt (default), or random keys and values "
                             "written in place (a pass's time does not depend on them: minutes saved at 24,000 tokens)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import numba

    from specx.core.draft import Draft
    from specx.core.model.load import builtin_gguf
    from specx.core.model.quantized import forward as qforward
    from specx.core.model.quantized import kernel as qkernel
    from specx.core.model.quantized.attention import attention
    from specx.core.model.quantized.engine import KVCache, QuantEngine, prefill

    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    engine = QuantEngine(args.model or builtin_gguf("smollm2-135m"), context=max(contexts) + 1200)
    model, cfg = engine.model, engine.model.config
    group = cfg.heads // cfg.kv_heads
    kernels = {"now": (model._layers, attention(group, cfg.head_dim))}
    if args.compare_attention:
        other = load_attention(args.compare_attention).attention(group, cfg.head_dim)
        run_any = next(iter(qkernel._ANY.values()))
        kernels["compared"] = (qforward.build_layers(run_any, other), other)
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    result = {"model": str(engine.path), "cpu": _cpu(), "threads": numba.get_num_threads(), "fill": args.fill, "contexts": {}}
    for context in contexts:
        session = engine.start(rng.integers(0, vocab, size=context if args.fill == "prompt" else 16).tolist())
        if args.fill == "random":
            _fill_random(session.kv, context, rng)
        figures: dict[str, dict] = {name: {"pass_ms": {}} for name in kernels}
        for n in rows:  # the attentions take turns at each size: the machine's load is shared alike
            draft = Draft(rng.integers(0, vocab, size=n - 1).tolist(), list(range(-1, n - 2)), [1.0] * (n - 1),
                          float(n - 1), 1)

            def one_pass() -> None:
                session.score([int(rng.integers(vocab))], draft)
                session.keep_path([])
            for name, (layers, _) in kernels.items():
                model._layers = layers
                figures[name]["pass_ms"][n] = round(median_ms(one_pass, args.repeats), 3)
        kv, base = session.kv, session.kv.length
        long_tokens, short_tokens = rng.integers(0, vocab, 1000).tolist(), rng.integers(0, vocab, 512).tolist()

        def long_prefill() -> None:
            prefill(model, kv, long_tokens)
            kv.keep(base, [])
        for name, (layers, attend) in kernels.items():
            model._layers = layers
            long_ms = median_ms(long_prefill, max(2, args.repeats // 3)) / 1000
            short_ms = median_ms(lambda: prefill(model, KVCache(cfg), short_tokens), max(2, args.repeats // 3)) / 512
            figures[name]["prefill_ms_per_token"] = {"1000_after_context": round(long_ms, 3),
                                                     "512_alone": round(short_ms, 3)}
            figures[name]["attention_alone"] = _attention_alone(attend, cfg, context, rows, args.repeats)
        model._layers = kernels["now"][0]
        result["contexts"][context] = figures
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for context, figures in result["contexts"].items():
        print(f"\n{context:,} cached tokens, {result['cpu']}, {result['threads']} threads (ms)")
        print("attention   " + "".join(f"{n:>9}" for n in rows) + "   4/1   prefill 1000 after / 512 alone")
        for name, f in figures.items():
            p, pre = f["pass_ms"], f["prefill_ms_per_token"]
            ratio = p[4] / p[1] if 4 in p and 1 in p else float("nan")
            print(f"{name:<10}  " + "".join(f"{p[n]:>9.2f}" for n in rows) + f"  {ratio:5.2f}   "
                  f"{pre['1000_after_context']:.3f} / {pre['512_alone']:.3f}")
            a = f["attention_alone"]
            print(f"{'':<10}  attention alone, one layer: " + ", ".join(
                f"{n} rows {a[n]['ms']:.3f} ms ({a[n]['gflop_s']:.0f} GFLOP/s)" for n in a))


def _fill_random(kv, context: int, rng) -> None:  # noqa: ANN001 - the engine's KVCache
    """`context` cached positions of random float16 keys and values, written in place."""
    kv.reserve(context + 64)
    tiles = -(-context // 16)
    for keys, values in zip(kv.keys, kv.values):
        keys[:, :tiles] = rng.standard_normal(keys[:, :tiles].shape, dtype=np.float32).astype(np.float16).view(keys.dtype)
        values[:, :context] = rng.standard_normal(values[:, :context].shape, dtype=np.float32).astype(np.float16).view(values.dtype)
    kv.length = context


def _attention_alone(attend, cfg, context: int, rows: list[int], repeats: int) -> dict:  # noqa: ANN001
    import numba

    rng = np.random.default_rng(1)
    kv, dim, heads = cfg.kv_heads, cfg.head_dim, cfg.heads
    cap = context + max(rows) + 16
    keys = rng.standard_normal((kv, cap // 16, dim, 16)).astype(np.float16).view(np.uint16)
    values = rng.standard_normal((kv, cap, dim)).astype(np.float16).view(np.uint16)
    key_list, value_list = numba.typed.List([numba.typed.List([keys])]), numba.typed.List([numba.typed.List([values])])
    out = {}
    for n in rows:
        q = rng.standard_normal((n, heads, dim)).astype(np.float32)
        args = (q, key_list, value_list, 0, np.array([0, n], np.int64), np.array([context], np.int64),
                numba.typed.List([np.tril(np.ones((n, n), np.uint8))]), np.float32(dim ** -0.5), np.empty_like(q))
        ms = median_ms(lambda: attend(*args), repeats)
        flops = 4 * n * context * heads * dim  # q.k and p.v: a multiply and an add each
        out[n] = {"ms": round(ms, 4), "gflop_s": round(flops / ms / 1e6, 1)}
    return out


def _cpu() -> str:
    from specx.core.model import cpu

    return cpu.model_name()


if __name__ == "__main__":
    main()
