"""An agent-like workload on the built-in model: text-to-SQL requests over the Spider schemas.

Each request is a DAIL-SQL-style prompt (the database schema, then earlier question/SQL pairs
on the same database as examples, then the new question) answered greedily; with `--shots 0`,
the schema and the question only (the examples then reach specx only through its global index of
earlier answers, and prompt lookup not at all). The same requests go
through plain decoding, transformers' own prompt lookup (`prompt_lookup_num_tokens`) and specx
(suffix drafts from the prompt and from earlier answers, tree verification, cost-aware draft
size); every output is compared with plain decoding's. The first `--warmup` requests are run but
not timed (the model's first passes are slow, and specx's global index starts empty). With
`--history N`, specx first serves the N requests before those, alone and untimed, learning their
answers into its global index as a server that has been running would have.

    .venv/bin/python examples/text2sql_bench.py --requests 24 --json

Needs ../shared/agent-data/text2sql-spider-dail-spider2 (Spider dev set and schemas) beside the
checkout, or --spider pointing at a folder with spider_dev.json and spider_tables.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specx.stack import assemble
from specx.home import keep_cost, specx_home
from specx.output import progress
from specx.core.cost.acceptance import AcceptanceModel
from specx.core.decode.generate import generate
from specx.core.decode.loop import collect
from specx.core.decode.request import Decoding
from specx.core.decode.speculate import SuffixDrafter
from specx.core.model.load import load_model
from specx.core.model.prefix_cache import PrefixCache
from specx.core.model.transformers.prefix_cache import TransformersPrefixCache
from specx.core.predict.compare import STOCK, compare, summary

HERE = Path(__file__).resolve().parent
DEFAULT_SPIDER = HERE.parent.parent / "shared" / "agent-data" / "text2sql-spider-dail-spider2"


def spider_prompts(folder: Path, num: int, shots: int = 3) -> list[str]:
    """The first `num` dev questions that have `shots` earlier questions on the same database."""
    dev = json.loads((folder / "spider_dev.json").read_text())
    schemas = {t["db_id"]: t for t in json.loads((folder / "spider_tables.json").read_text())}
    seen: dict[str, list[dict]] = {}
    prompts = []
    for item in dev:
        earlier = seen.setdefault(item["db_id"], [])
        if len(earlier) >= shots:
            schema = schemas[item["db_id"]]
            tables = []
            for t, name in enumerate(schema["table_names_original"]):
                cols = [c for ti, c in schema["column_names_original"] if ti == t]
                tables.append(f"CREATE TABLE {name} ({', '.join(cols)});")
            lines = [f"/* SQLite database {item['db_id']} */", *tables, ""]
            for ex in earlier[len(earlier) - shots :]:
                lines += [f"/* Question: {ex['question']} */", ex["query"].strip() + ";", ""]
            lines += [f"/* Question: {item['question']} */", "SELECT"]
            prompts.append("\n".join(lines))
            if len(prompts) == num:
                break
        earlier.append(item)
    return prompts


def serve_history(engine, tok, prompts, drafter, max_new_tokens, cost, prefix_cache_tokens) -> list[list[int]]:
    """specx alone over `prompts` (untimed): its global index learns every answer, as when serving.
    Returns the answers."""
    acceptance = AcceptanceModel()
    prefixes = engine.new_prefix_cache(prefix_cache_tokens) if prefix_cache_tokens else None
    settings = Decoding(max_new_tokens=max_new_tokens, eos_token_ids=tok.eos_token_id)
    answers = []
    with progress() as bar:
        for prompt in bar.track(prompts, description=f"history: specx serves {len(prompts)} earlier requests"):
            answers.append(collect(generate(engine, prompt, drafter, settings, cost=cost, acceptance=acceptance,
                                            prefix_cache=prefixes)).tokens)
    return answers


def uncached_tokens(prompts, budget) -> list[int]:
    """The prompt tokens each request prefills behind a prefix cache of `budget` tokens that sees the
    prompts in order (each but its last token, as generate prefills it): PrefixCache's bookkeeping
    without the model."""
    cache = PrefixCache(budget)
    return [cache.plan(prompt[:-1]) for prompt in prompts]


def prefill_curve(net, sizes=(16, 64, 128, 256, 512), repeats: int = 3):
    """Seconds to prefill n prompt tokens into an empty cache (the median of `repeats`), as a curve."""
    import time

    from specx.core.cost.forward import ForwardCost
    from specx.core.predict.curves import CostCurve

    rng = np.random.default_rng(0)
    seconds = []
    for n in sizes:
        runs = []
        for r in range(repeats + 1):
            tokens = rng.integers(0, net.config.vocab_size, size=n).tolist()
            t0 = time.perf_counter()
            TransformersPrefixCache(0).prefill(net, tokens)
            if r:  # the first run warms up
                runs.append(time.perf_counter() - t0)
        seconds.append(float(np.median(runs)))
    return CostCurve("prefill", ForwardCost(tuple(sizes), tuple(seconds)))


def projection(prompts, outputs, history, timed, cost, prefill_cost, max_spec_factor, prefix_cache_tokens) -> dict:
    """What `specx entropy` / `specx replay` project from the recorded outputs alone (core/predict/estimate.py):
    specx's speedup over plain decoding on the timed requests, model-free, with the history the run
    gave them, on the forward-cost curve this run learned (at the median context of the timed
    requests) and on the shipped cpu curve. `decoding`: the passes only, as `specx entropy` projects;
    `with_prefill`: plus one pass over each prompt's uncached tokens (the same for both methods)."""
    from specx.core.cost.forward import ForwardCost
    from specx.core.predict.curves import CostCurve, builtin_curves
    from specx.core.predict.estimate import projected_speedup, replay_sample

    positions = [i for i in range(len(prompts)) if timed(i)]
    context = int(np.median([len(prompts[i]) + len(outputs[i]) // 2 for i in positions]))
    sizes = cost.snapshot().sizes  # the learned curve's grid
    measured = CostCurve("measured", ForwardCost(sizes, tuple(cost(n, context) for n in sizes)),
                         f"the curve this run learned, at a {context}-token context")
    curves = [measured, builtin_curves()["cpu"]]
    names = [c.name for c in curves]
    arrays = lambda seqs: [np.asarray(s, dtype=np.int32) for s in seqs]  # noqa: E731
    uncached = uncached_tokens(prompts, prefix_cache_tokens)
    one = cost(1, context)  # prefill costs in one-token passes
    result = {"context": context, "measured_curve": measured.points(), "prefill_curve": prefill_cost.points(),
              "prefill_tokens": sum(uncached[i] for i in positions)}
    for name, prefill in (("decoding", None),
                          ("with_prefill", [prefill_cost(uncached[i]) / one if uncached[i] else 0.0 for i in positions])):
        replayed = replay_sample(arrays(outputs), ["timed"] * len(outputs), positions,
                                 arrays([prompts[i] for i in positions]),
                                 lambda: SuffixDrafter(max_spec_factor=max_spec_factor), curves=curves,
                                 warm=arrays(history), prefill=prefill)
        result[name] = {k: v["vs_plain"] for k, v in projected_speedup(replayed, names).items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="timed requests (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=8, help="requests run first, untimed")
    parser.add_argument("--history", type=int, default=0,
                        help="requests specx serves alone before the warm-up, untimed, learning into its global index "
                             "(a server that has been running)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shots", type=int, default=3,
                        help="earlier question/SQL pairs on the same database in each prompt (0: schema and question only)")
    parser.add_argument("--max-spec-factor", type=float, default=4.0,
                        help="specx: draft up to factor x match length (cost-aware sizing cuts what does not pay)")
    parser.add_argument("--dtype", default="auto", help="weights dtype: auto (float32 on CPU), float32, bfloat16")
    parser.add_argument("--methods", default="plain,prompt_lookup,specx")
    parser.add_argument("--stock", action="store_true",
                        help=f"also run plain decoding on stock transformers (no specx kernels) as {STOCK}")
    parser.add_argument("--prefix-cache-tokens", type=int, default=8192,
                        help="KV entries of past prompts each method may reuse (a serving engine's prefix cache; "
                             "0: prefill every prompt whole)")
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--cache", type=Path, default=specx_home() / "models", help="model cache ($SPECX_HOME/models)")
    parser.add_argument("--predict", action="store_true",
                        help="also project specx's speedup from the plain outputs alone, model-free (core/predict/estimate.py), "
                             "beside the measured one")
    parser.add_argument("--relearn", action="store_true",
                        help="forget the forward-pass cost learned by earlier runs for this model, dtype and machine "
                             "($SPECX_HOME/cost) and learn it afresh from this run's passes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no spider_dev.json in {args.spider} (pass --spider FOLDER)")
    torch.set_grad_enabled(False)
    stack = assemble("smollm2-135m", backend="transformers", dtype=args.dtype, say=lambda m: print(m, file=sys.stderr),
                     check_template=False, speculation=False, relearn=args.relearn, cache_dir=args.cache)
    engine, tok, cost = stack.engine, stack.tokenizer, stack.cost
    texts = spider_prompts(args.spider, args.history + args.warmup + args.requests, args.shots)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    drafter = SuffixDrafter(max_spec_factor=args.max_spec_factor)
    history = []
    if args.history:
        history = serve_history(engine, tok, prompts[: args.history], drafter, args.max_new_tokens, cost,
                                args.prefix_cache_tokens)
        prompts = prompts[args.history :]
    methods = args.methods.split(",") + ([STOCK] if args.stock else [])
    stock = load_model("smollm2-135m", args.cache, dtype=args.dtype, kernels=False)[0] if args.stock else None
    timed = lambda i: i >= args.warmup  # noqa: E731
    print(f"running {', '.join(methods)} over {len(prompts)} requests, taking turns ...", file=sys.stderr)
    with progress() as bar:
        task = bar.add_task("requests x methods", total=len(prompts) * len(methods))
        runs = compare(engine, prompts, drafter, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                       methods=methods, cost=cost, timed=timed,
                       stock_model=stock, prefix_cache_tokens=args.prefix_cache_tokens,
                       on_call=lambda: bar.advance(task))
    summed = summary(runs, timed)
    summary_ = summed.to_json()["methods"]
    keep_cost(cost)
    projected = None
    if args.predict and "plain" in runs and "specx" in runs:
        projected = projection(prompts, runs["plain"].outputs, history, timed, cost, prefill_curve(engine.model),
                               args.max_spec_factor, args.prefix_cache_tokens)
    if args.json:
        print(json.dumps({"methods": summary_, "steady": summed.steady, "projected": projected, "requests": args.requests, "warmup": args.warmup, "history": args.history,
                          "shots": args.shots,
                          "max_new_tokens": args.max_new_tokens, "prefix_cache_tokens": args.prefix_cache_tokens,
                          "dtype": engine.precision, "kernels": engine.kernels}, indent=2))
        return
    print(f"{'method':<15}{'tokens/s':>10}{'speedup':>9}{'past prefill':>14}{'identical':>11}")
    for name, s in summary_.items():
        print(f"{name:<15}{s['tokens_per_s']:>10.1f}{s.get('speedup_vs_plain', 1.0):>8.2f}x"
              f"{s.get('decode_speedup_vs_plain', 1.0):>13.2f}x{s['identical_calls']:>6}/{s['calls']}")
    print("higher tokens/s and speedup (vs plain decoding) are better; past prefill: the speedup of the time after "
          "each prompt's prefill; identical: outputs equal to plain decoding's")
    if projected:
        specx = summary_["specx"]
        print("projected from the outputs alone (model-free, core/predict/estimate.py), specx x plain decoding: "
              + ", ".join(f"{projected['with_prefill'][k]:.2f}x with the prefill ({projected['decoding'][k]:.2f}x "
                          f"decoding only) on the {k} curve" for k in projected["decoding"])
              + f"; measured {specx.get('speedup_vs_plain', 0):.2f}x ({specx.get('decode_speedup_vs_plain', 0):.2f}x "
                f"past the prefill); prompt tokens prefilled: {projected['prefill_tokens']:,} simulated, "
                f"{summary_['plain']['prefill_tokens']:,} measured")
    if summed.busy:
        print(f"warning: {summed.busy}")
    shown = "specx" if "specx" in runs else methods[0]
    print(f"example output ({shown}):", repr(tok.decode(runs[shown].outputs[-1])[:200]))


if __name__ == "__main__":
    main()
