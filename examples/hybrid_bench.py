"""The hybrid drafter against suffix-only, the table alone, prompt lookup and plain decoding, in one
sitting on the built-in model (issue 41's benchmark).

Workloads: text-to-SQL over the Spider schemas with 3 earlier question/SQL pairs in each prompt
(`spider3`) or none (`spider0`, the examples reaching specx only through its global index), and
plain chat answers to general questions (`chat`: little repetition, what history cannot reach).
The methods take turns request by request (core/predict/compare.py); every output is compared
with plain decoding's. Each specx method has its own drafter, acceptance model and successor
table, which start empty and learn from the run's passes (the first `--warmup` requests untimed).
The MMSQL multi-agent log runs through `specx replay --model ... --drafter suffix,table,hybrid`.

    .venv/bin/python examples/hybrid_bench.py --workload spider0 --requests 24 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specx.stack import assemble
from specx.home import keep_cost, specx_home
from specx.output import progress
from specx.core.decode.hybrid import TAU, HybridDrafter, table_nodes
from specx.core.decode.speculate import SuffixDrafter
from specx.core.index.successors import TABLE_K, SuccessorTable
from specx.core.predict.compare import Speculator, compare, summary

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text2sql_bench import DEFAULT_SPIDER, spider_prompts  # noqa: E402

QUESTIONS = [  # general questions: answers in prose, little shared with any log
    "Why is the sky blue?", "How do vaccines train the immune system?", "What causes the seasons on Earth?",
    "Explain how a bicycle stays upright.", "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?", "Why do cats purr?", "What makes bread rise?",
    "How do bees make honey?", "Why does ice float on water?", "What is photosynthesis?",
    "How does a rainbow form?", "Why do we have leap years?", "What is the water cycle?",
    "How do airplanes fly?", "Why do leaves change color in autumn?", "What is a black hole?",
    "How does the heart pump blood?", "Why is the ocean salty?", "What are tides and what causes them?",
    "How does a compass work?", "Why do we dream?", "What is the greenhouse effect?",
    "How do solar panels make electricity?", "Why do onions make people cry?", "How do fish breathe underwater?",
    "What causes thunder?", "How does soap clean things?", "Why do stars twinkle?",
    "How do earthquakes happen?", "What is inflation in economics?", "How does a camera capture a picture?",
    "Why do birds migrate?", "How is glass made?", "What causes the northern lights?",
    "How do plants know which way is up?", "Why does the moon have phases?", "How do noise-cancelling headphones work?",
    "What is the difference between a virus and a bacterium?", "How do glaciers move?",
]


def chat_prompts(tok, num: int) -> list[str]:
    """`num` general questions, each as a one-turn chat in the model's template."""
    if num > len(QUESTIONS):
        sys.exit(f"error: the chat workload has {len(QUESTIONS)} questions; ask for at most that many requests")
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS[:num]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("spider3", "spider0", "chat"), default="spider0")
    parser.add_argument("--requests", type=int, default=24, help="timed requests (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=8, help="requests run first, untimed (the tables learn)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default="plain,prompt_lookup,specx,specx_table,specx_hybrid",
                        help="of plain, prompt_lookup, specx (suffix only), specx_table, specx_hybrid and "
                             "specx_hybrid_tau1 (the table's tree joins only below a suffix score of 1) and "
                             "specx_hybrid_leaves (the table's tree beneath the suffix tree's leaves too, not only "
                             "after the context)")
    parser.add_argument("--tau", type=float, default=TAU, help="the hybrid's suffix score below which the table joins")
    parser.add_argument("--table-nodes", type=int, help="the table's tree before sizing (default: what specx uses "
                        "on the engine: core.decode.hybrid.table_nodes)")
    parser.add_argument("--k", type=int, default=TABLE_K, help="successors kept per token")
    parser.add_argument("--dtype", default="auto", help="weights dtype: auto (float32 on CPU), float32, bfloat16")
    parser.add_argument("--backend", default="transformers", help="transformers or llama.cpp")
    parser.add_argument("--prefix-cache-tokens", type=int, default=8192)
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--cache", type=Path, default=specx_home() / "models", help="model cache ($SPECX_HOME/models)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    stack = assemble("smollm2-135m", backend=args.backend, dtype=args.dtype, say=lambda m: print(m, file=sys.stderr),
                     check_template=False, speculation=False, cache_dir=args.cache)
    engine, tok, cost = stack.engine, stack.tokenizer, stack.cost
    args.table_nodes = args.table_nodes or table_nodes(engine.tree_unsupported)
    num = args.warmup + args.requests
    texts = chat_prompts(tok, num) if args.workload == "chat" else \
        spider_prompts(args.spider, num, 3 if args.workload == "spider3" else 0)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    suffix = lambda: SuffixDrafter(max_spec_factor=4.0)  # noqa: E731  (text2sql_bench's specx)

    def with_table(inner: SuffixDrafter | None, **options: Any) -> Speculator:
        """A HybridDrafter over `inner` (None: the table alone) with a successor table of its own."""
        successors = SuccessorTable(engine.vocab_size, k=args.k)
        return Speculator(HybridDrafter(inner, successors, max_nodes=args.table_nodes, **options), successors)

    speculators = {
        "specx": Speculator(suffix()),
        "specx_table": with_table(None),
        "specx_hybrid": with_table(suffix(), tau=args.tau),
        "specx_hybrid_tau1": with_table(suffix(), tau=1.0),
        "specx_hybrid_leaves": with_table(suffix(), tau=args.tau, leaves=True),
    }
    methods = args.methods.split(",")
    if not engine.prompt_lookup:
        methods = [m for m in methods if m != "prompt_lookup"]
    timed = lambda i: i >= args.warmup  # noqa: E731
    print(f"{args.workload}: {', '.join(methods)} over {len(prompts)} requests, taking turns ...", file=sys.stderr)
    with progress() as bar:
        task = bar.add_task("requests x methods", total=len(prompts) * len(methods))
        runs = compare(engine, prompts, None, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                       methods=methods, cost=cost, timed=timed, prefix_cache_tokens=args.prefix_cache_tokens,
                       speculators=speculators, on_call=lambda: bar.advance(task))
    summed = summary(runs, timed)
    rows = summed.to_json()["methods"]
    keep_cost(cost)
    base = rows.get("specx", {}).get("tokens_per_step")
    for name, row in rows.items():
        if base and row.get("tokens_per_step"):
            row["tokens_per_step_vs_suffix"] = row["tokens_per_step"] / base
    if args.json:
        print(json.dumps({"workload": args.workload, "methods": rows, "steady": summed.steady, "busy": summed.busy,
                          "requests": args.requests, "warmup": args.warmup, "max_new_tokens": args.max_new_tokens,
                          "tau": args.tau, "table_nodes": args.table_nodes, "k": args.k, "backend": engine.name,
                          "dtype": engine.precision,
                          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "table_tokens": {m: len(sp.successors) for m, sp in speculators.items()
                                           if sp.successors is not None}}, indent=2))
        return
    print(f"{'method':<14}{'tokens/s':>10}{'x plain':>9}{'tokens/step':>13}{'x suffix':>10}{'drafted':>9}{'identical':>11}")
    for name, r in rows.items():
        print(f"{name:<14}{r['tokens_per_s']:>10.1f}{r.get('speedup_vs_plain', 1.0):>8.2f}x"
              f"{r.get('tokens_per_step', 1.0):>13.2f}{r.get('tokens_per_step_vs_suffix', 0.0):>9.2f}x"
              f"{r.get('drafted_per_step', 0.0):>9.1f}{'-' if r['identical_calls'] is None else r['identical_calls']:>6}/{r['calls']}")
    print("tokens/step: output tokens per verification pass (plain: 1); identical: outputs equal to plain decoding's")
    if summed.busy:
        print(f"warning: {summed.busy}")


if __name__ == "__main__":
    main()
