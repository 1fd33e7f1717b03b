"""The quantized engine's passes at agents' context lengths: one pass over k rows after N cached
tokens, a long prefill against a short one, and the attention alone; for each way of keeping the
keys and values (`--formats` KEYS/VALUES: keys q8 or f16, values bf16 or f16; the default the
engine's own) in the same process, taking turns.

    python examples/attention_bench.py --contexts 600,6000
    python examples/attention_bench.py --contexts 6000 --formats q8/bf16,q8/f16,f16/f16 --json

Prints a table per context (ms, median of --repeats) and, with --json, one JSON object. The passes
run on the engine's own session (a random prompt of N tokens; each pass keeps its pending token, so
the cache grows by one a pass); the prefill row is ms per token of 1,000 tokens after N cached
against a 512-token prompt alone; the attention row times one layer's attention alone (its keys and
values random, in cache after the first call) and its float32 arithmetic rate.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


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
    parser.add_argument("--formats", default=None, help="how the cache keeps keys/values, comma-separated, timed "
                        "side by side: keys q8 or f16, values bf16 or f16, e.g. q8/bf16,q8/f16 (default: the engine's)")
    parser.add_argument("--fill", choices=("prompt", "random"), default="prompt",
                        help="how the cache is filled: a prefilled random prompt (default), or random keys and values "
                             "written in place (a pass's time does not depend on them: minutes saved at 24,000 tokens)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import numba

    from specx.core.draft import Draft
    from specx.core.model.load import builtin_gguf
    from specx.core.model.quantized.attention import attention
    from specx.core.model.quantized.keys import key_store
    from specx.core.model.quantized.values import value_store
    from specx.core.model.quantized.engine import KVCache, QuantEngine
    from specx.core.model.sessions import prefill

    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    path = args.model or builtin_gguf("smollm2-135m")
    from specx.core.model.quantized.values import default_values

    formats = {name: tuple(name.split("/")) for name in (args.formats or f"q8/{default_values()}").split(",")}
    if any(len(f) != 2 for f in formats.values()):
        parser.error(f"--formats {args.formats!r}: KEYS/VALUES pairs, e.g. q8/bf16,q8/f16")
    engines = {name: QuantEngine(path, context=max(contexts) + 1200, keys=k, values=v) for name, (k, v) in formats.items()}
    first = next(iter(engines.values()))
    cfg, vocab = first.model.config, first.vocab_size
    group = cfg.heads // cfg.kv_heads
    rng = np.random.default_rng(0)
    result = {"model": str(first.path), "cpu": _cpu(), "threads": numba.get_num_threads(), "fill": args.fill,
              "contexts": {}}
    for context in contexts:
        prompt = rng.integers(0, vocab, size=context if args.fill == "prompt" else 16).tolist()
        sessions = {name: engine.start(prompt) for name, engine in engines.items()}
        if args.fill == "random":
            for name, session in sessions.items():
                _fill_random(session.kv, context, np.random.default_rng(context), key_store(formats[name][0]),
                             value_store(formats[name][1]))
        figures: dict[str, dict] = {name: {"pass_ms": {}} for name in engines}
        for n in rows:  # the formats take turns at each size: the machine's load is shared alike
            draft = Draft(rng.integers(0, vocab, size=n - 1).tolist(), list(range(-1, n - 2)), [1.0] * (n - 1),
                          float(n - 1), 1)
            for name, session in sessions.items():
                def one_pass(session=session) -> None:  # noqa: ANN001
                    session.score([int(rng.integers(vocab))], draft)
                    session.keep_path([])
                figures[name]["pass_ms"][n] = round(median_ms(one_pass, args.repeats), 3)
        long_tokens, short_tokens = rng.integers(0, vocab, 1000).tolist(), rng.integers(0, vocab, 512).tolist()
        for name, engine in engines.items():
            model, kv = engine.model, sessions[name].kv
            base = kv.length

            def long_prefill(model=model, kv=kv, base=base) -> None:  # noqa: ANN001
                prefill(model, kv, long_tokens)
                kv.keep(base, [])
            long_ms = median_ms(long_prefill, max(2, args.repeats // 3)) / 1000
            short_ms = median_ms(lambda model=model: prefill(model, KVCache(model.config), short_tokens),
                                 max(2, args.repeats // 3)) / 512
            figures[name]["prefill_ms_per_token"] = {"1000_after_context": round(long_ms, 3),
                                                     "512_alone": round(short_ms, 3)}
            k, v = formats[name]
            figures[name]["attention_alone"] = _attention_alone(attention(group, cfg.head_dim, keys=k, values=v),
                                                                (key_store(k), value_store(v)), model.config,
                                                                context, rows, args.repeats)
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


def _fill_random(kv, context: int, rng, store_keys, store_values) -> None:  # noqa: ANN001 - the engine's KVCache
    """`context` cached positions of random keys and values, written in place as the cache keeps them."""
    kv.reserve(context + 64)
    shape = (context, kv.config.kv_heads, kv.config.head_dim)
    for keys, values in zip(kv.keys, kv.values):
        store_keys(keys, rng.standard_normal(shape, dtype=np.float32), 0, context, 0)
        store_values(values, rng.standard_normal(shape, dtype=np.float32), 0, context, 0)
    kv.length = context


def _attention_alone(attend, stores, cfg, context: int, rows: list[int], repeats: int) -> dict:  # noqa: ANN001
    import numba

    from specx.core.model.quantized.engine import KVCache

    rng = np.random.default_rng(1)
    dim, heads = cfg.head_dim, cfg.heads
    cache = KVCache(cfg, context + max(rows) + 16)
    _fill_random(cache, context + max(rows), rng, *stores)  # the new rows' keys and values too
    keys, values = cache.keys[0], cache.values[0]
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
