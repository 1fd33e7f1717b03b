"""Drafting time per request-step: specx's vLLM drafter against ArcticInference's, outside vLLM.

Both are driven exactly as vLLM 0.32's suffix proposer drives them (tests/vllm_proposer.py is
its code, replicated), over stored calls: each call's prompt (its last --prompt-window tokens)
starts a request, its recorded output is what the model "generates", and a draft is accepted up
to its first wrong token (an oracle verifier, as `specx replay`). Requests run --concurrency at a
time; both drafters start empty and learn from the outputs as they finish. The whole proposer
call is timed (vLLM's loop included, the same for both), as examples/vllm_bench.py times it in
the engine, and divided by request-steps. Methods alternate for --rounds rounds; the median
round is reported.

    python examples/proposer_bench.py --db agents.db --source multi-agent_gemini --limit 200 --json

The reference needs `arctic_inference.suffix_decoding` (examples/build_reference.sh builds it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from vllm_proposer import Batch, propose  # noqa: E402


def drive(cache, prompts: list[list[int]], outputs: list[list[int]], k: int, depth: int,
          concurrency: int) -> dict:
    """Serve every call through `cache`; returns proposer seconds, request-steps, accepted tokens."""
    batch = Batch({}, order=[])
    pending = list(range(len(prompts)))
    pos: dict[str, int] = {}
    new: dict[str, list[int]] = {}
    spent, steps, accepted = 0.0, 0, 0
    while pending or batch.order:
        while pending and len(batch.order) < concurrency:  # admit: the first token comes from prefill
            n = pending.pop(0)
            rid = f"r{n}"
            batch.prompts[rid] = prompts[n]
            batch.outputs[rid] = []
            batch.order.append(rid)
            pos[rid], new[rid] = 0, outputs[n][:1]
        sampled = []
        for rid in batch.order:
            batch.outputs[rid].extend(new[rid])
            pos[rid] += len(new[rid])
            sampled.append(list(new[rid]))
        t = time.perf_counter()
        drafts = propose(cache, batch, sampled, num_speculative_tokens=k, max_tree_depth=depth)
        spent += time.perf_counter() - t
        steps += len(batch.order)
        done = []
        for rid, draft in zip(batch.order, drafts):
            out = outputs[int(rid[1:])]
            if pos[rid] >= len(out):
                done.append(rid)
                continue
            good = 0
            for a, b in zip(draft, out[pos[rid]:]):
                if a != b:
                    break
                good += 1
            accepted += good
            new[rid] = out[pos[rid]: pos[rid] + good + 1]
        batch.order = [r for r in batch.order if r not in done]  # stopped lazily, at the next call
    t = time.perf_counter()
    propose(cache, batch, [])
    spent += time.perf_counter() - t
    return {"seconds": spent, "steps": steps, "accepted": accepted}


def load(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
    from specx.store.db import Store
    from specx.store.prompts import prompt_tokens
    from specx.store.selection import select_calls

    tokenizer = load_tokenizer(args.model)
    with Store(Path(args.db)) as store:
        tid = store.tokenizer_id(tokenizer_fingerprint(tokenizer))
        if tid is None:
            sys.exit(f"proposer_bench: {args.db} holds no tokens of {args.model}: `specx ingest LOGS --db {args.db}`")
        calls = select_calls(store, tid, sources=args.source, agents=args.agent, limit=args.limit)
        if not calls:
            sys.exit(f"proposer_bench: no stored calls match in {args.db}")
        prompts = [p[-args.prompt_window:].tolist() for p in prompt_tokens(store, tokenizer, calls, args.prompt_window)]
        outputs = [store.call_tokens(c.id, tid).tolist() for c in calls]
    return prompts, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="a specx store (specx ingest)")
    parser.add_argument("--source", action="append", help="stored source(s) to draw calls from")
    parser.add_argument("--agent", action="append", help="agent role(s)")
    parser.add_argument("--limit", type=int, default=200, help="calls, in stored order")
    parser.add_argument("--model", default="smollm2-135m", help="tokenizer (default: the built-in model's)")
    parser.add_argument("--prompt-window", type=int, default=1024, help="last prompt tokens a request starts with")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--depth", type=int, default=24, help="suffix_decoding_max_tree_depth")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from specx.core.index.suffix_cache import SuffixCache
    from specx.core.index.suffix_index import SuffixIndex

    makers = {"specx": lambda: SuffixCache(SuffixIndex(64), max_tree_depth=args.depth, linger_s=0.0)}
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        makers["suffix"] = lambda: SuffixDecodingCache(max_tree_depth=args.depth, max_cached_requests=10000)
    except ImportError:
        print("proposer_bench: no arctic_inference.suffix_decoding (examples/build_reference.sh builds it): "
              "specx alone", file=sys.stderr)
    prompts, outputs = load(args)
    print(f"proposer_bench: {len(prompts)} calls, {sum(map(len, outputs))} output tokens", file=sys.stderr)
    report: dict = {"params": {k: v for k, v in vars(args).items() if k != "json"}}
    for c in args.concurrency:
        rows: dict[str, list[dict]] = {name: [] for name in makers}
        for name, make in makers.items():  # compile and warm once, untimed
            drive(make(), prompts[:8], outputs[:8], args.k, args.depth, c)
        for r in range(args.rounds):
            for name, make in makers.items():
                rows[name].append(drive(make(), prompts, outputs, args.k, args.depth, c))
                print(f"proposer_bench: concurrency {c}, round {r + 1}, {name}: "
                      f"{rows[name][-1]['seconds'] / rows[name][-1]['steps'] * 1e6:.1f} us/step", file=sys.stderr)
        methods = {}
        for name, runs in rows.items():
            us = sorted(x["seconds"] / x["steps"] * 1e6 for x in runs)
            methods[name] = {"us_per_step": statistics.median(us), "us_per_step_min": us[0],
                             "steps": runs[0]["steps"], "accepted_per_step": runs[0]["accepted"] / runs[0]["steps"]}
        if "suffix" in methods:
            methods["specx"]["ratio_to_suffix"] = methods["specx"]["us_per_step"] / methods["suffix"]["us_per_step"]
        report[f"concurrency_{c}"] = methods
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("proposer time per request-step (lower is better)")
    print(f"{'concurrency':>11} {'method':>8} {'us/step':>8} {'min':>8} {'accepted/step':>14} {'steps':>7}")
    for c in args.concurrency:
        for name, m in report[f"concurrency_{c}"].items():
            print(f"{c:>11} {name:>8} {m['us_per_step']:>8.1f} {m['us_per_step_min']:>8.1f} "
                  f"{m['accepted_per_step']:>14.3f} {m['steps']:>7}")


if __name__ == "__main__":
    main()
