"""specx on llama.cpp against llama.cpp's own decoding: text-to-SQL over the Spider schemas.

One run, the same prompts, the methods taking turns request by request (a machine that slows down
weighs on all alike), greedy, at most --max-new-tokens each:

- `llama.cpp`: llama-cpp-python's own `Llama.generate` (plain decoding), with the KV cache type
  specx uses (Q8_0: see core/model/llamacpp.py for why); every other output is compared with its.
- `llama.cpp f16`: the same with llama.cpp's default F16 KV cache (speed only; its tokens may differ).
- `llama.cpp prompt lookup`: llama-cpp-python's stock `LlamaPromptLookupDecoding` draft model.
- `specx llama.cpp`: specx's decode loop on llama.cpp (suffix drafts, learned cost, guard).
- `specx transformers`: specx on its transformers engine (the built-in model de-quantized to float32).
- `quantized plain`: specx's quantized engine (core/model/quantized/engine.py, the GGUF's own 4-bit weights)
  decoding one token per pass: what `specx serve --backend quantized --no-speculation` runs.
- `specx quantized`: specx on the quantized engine (suffix drafts verified as trees).
- `specx auto`: specx on the engine `--backend auto` picks here (`specx engines`' kept choice, else
  the prior: cli/backends.py), with caches of its own: what `specx serve` with no option runs.

The header names the CPU and its instruction sets: which engine wins depends on them (docs/llamacpp.md).
"identical" compares each specx method with its own engine's plain decoding (llama.cpp's for specx
llama.cpp, `quantized plain` for specx quantized): lossless means equal there. Two engines' greedy
outputs can part ways now and then (each rounds its arithmetic its own way), so they are not
compared with each other. `--model FILE` runs another GGUF (examples/model_ladder.py's random-weight
files: their tokens/s time the engines; their outputs are noise, so no acceptance figure comes
from them).
`--store DB` takes the prompts from a store instead (the agent's own, e.g. SWE-agent turns of
2-8k tokens with `--source swe --min-prompt-tokens 2000`): long prompts, where prefill counts.

    .venv/bin/python examples/llamacpp_bench.py --requests 24 --json
    .venv/bin/python examples/llamacpp_bench.py --shots 0

Each method keeps its own KV cache from request to request and prefills only what a prompt does
not share with the last one (llama.cpp's one sequence; on transformers specx's prefix cache), as
a server would; the prefill is timed with the rest. Needs
llama-cpp-python (make setup) and ../shared/agent-data/text2sql-spider-dail-spider2 (or --spider).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from text2sql_bench import DEFAULT_SPIDER, spider_prompts  # noqa: E402

from specx.backends import llama_build, resolve_backend  # noqa: E402
from specx.home import keep_cost, model_cost, specx_home  # noqa: E402
from specx.output import progress  # noqa: E402
from specx.core.cost.acceptance import AcceptanceModel  # noqa: E402
from specx.core.decode.generate import generate  # noqa: E402
from specx.core.decode.loop import collect  # noqa: E402
from specx.core.decode.request import Decoding  # noqa: E402
from specx.core.model import cpu  # noqa: E402
from specx.core.model.transformers.engine import TransformersEngine  # noqa: E402
from specx.core.model.llamacpp import CACHE_TYPES, LlamaModel  # noqa: E402
from specx.core.model.quantized.engine import QuantEngine  # noqa: E402
from specx.core.model.load import builtin_gguf, load_model, load_tokenizer  # noqa: E402
from specx.core.decode.speculate import SuffixDrafter  # noqa: E402

METHODS = ("llama.cpp", "llama.cpp f16", "llama.cpp prompt lookup", "specx llama.cpp", "specx transformers",
           "quantized plain", "specx quantized", "specx auto")
N_CTX = 8192  # the built-in model's trained context: long agent prompts fit


def stock_llama(path: Path, threads: int, cache_type: str, lookup: bool):
    """llama-cpp-python's own Llama, as a user would make it (flash attention on, as specx runs it)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return Llama(model_path=str(path), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, flash_attn=True,
                 type_k=CACHE_TYPES[cache_type], type_v=CACHE_TYPES[cache_type], verbose=False,
                 draft_model=LlamaPromptLookupDecoding() if lookup else None,
                 logits_all=lookup)  # a draft model needs it in 0.3.36 (else it fails past n_batch tokens)


def stock_generate(llm, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    out: list[int] = []  # llama-cpp-python keeps the prefix this prompt shares with the last request
    for tok in llm.generate(prompt, temp=0.0, top_k=1):
        out.append(int(tok))
        if tok == eos or len(out) == max_new_tokens:
            break
    return out


def store_prompts(args: argparse.Namespace, tok) -> list[list[int]]:
    """The latest stored calls' prompts as the model reads them (chat template), at least
    --min-prompt-tokens long, cut to their last --max-prompt-tokens."""
    from specx.core.model.load import tokenizer_fingerprint
    from specx.store.db import Store
    from specx.store.prompts import model_prompts
    from specx.store.selection import select_calls

    with Store(args.store) as store:
        tokenizer_id = store.tokenizer_id(tokenizer_fingerprint(tok))
        if tokenizer_id is None:
            sys.exit(f"error: {args.store} holds no tokens of the built-in model's tokenizer")
        calls = select_calls(store, tokenizer_id, sources=[args.source] if args.source else None)
        prompts: list[list[int]] = []
        for i in range(len(calls) - 1, -1, -16):  # newest first, 16 calls a batch
            _, found = model_prompts(store, tok, calls[max(0, i - 15): i + 1], args.max_prompt_tokens + 1)
            prompts = [p[-args.max_prompt_tokens:] for p in found if len(p) >= args.min_prompt_tokens] + prompts
            if len(prompts) >= args.warmup + args.requests:
                break
    if len(prompts) < args.warmup + args.requests:
        sys.exit(f"error: {len(prompts)} prompts of at least {args.min_prompt_tokens} tokens in {args.store}")
    return prompts[-(args.warmup + args.requests):]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="timed requests (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=4, help="requests run first, untimed")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shots", type=int, default=3, help="earlier question/SQL pairs in each prompt")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (specx may choose 1 when faster)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--store", type=Path, help="take the prompts from this store (its latest calls) instead")
    parser.add_argument("--source", help="with --store: only calls whose source path holds this")
    parser.add_argument("--min-prompt-tokens", type=int, default=0, help="with --store: only prompts this long")
    parser.add_argument("--max-prompt-tokens", type=int, default=7900, help="with --store: prompts cut to this")
    parser.add_argument("--model", type=Path, help="another GGUF file (default: the built-in model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.store is None and not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no spider_dev.json in {args.spider} (pass --spider FOLDER)")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        sys.exit(f"error: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    say = lambda message: print(message, file=sys.stderr)  # noqa: E731
    name = str(args.model) if args.model else "smollm2-135m"
    path = args.model or builtin_gguf("smollm2-135m")
    tok = load_tokenizer(name, specx_home() / "models")
    eos = tok.eos_token_id
    if args.store is not None:
        prompts = store_prompts(args, tok)
        workload = f"{args.store} ({args.source or 'all sources'}), prompts of {min(map(len, prompts)):,}-" \
                   f"{max(map(len, prompts)):,} tokens"
    else:
        texts = spider_prompts(args.spider, args.warmup + args.requests, args.shots)
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        workload = f"text-to-SQL {args.shots}-shot"
    print(f"{cpu.model_name()}: {' '.join(cpu.instruction_sets()) or 'no AVX2'}; llama-cpp-python "
          f"{(llama_build() or {}).get('llama_cpp')}; {workload}", file=sys.stderr)

    runners, costs = {}, []
    if "llama.cpp" in methods:
        llm = stock_llama(path, args.threads, "q8_0", False)
        runners["llama.cpp"] = lambda p, llm=llm: stock_generate(llm, p, args.max_new_tokens, eos)
    if "llama.cpp f16" in methods:
        llm16 = stock_llama(path, args.threads, "f16", False)
        runners["llama.cpp f16"] = lambda p: stock_generate(llm16, p, args.max_new_tokens, eos)
    if "llama.cpp prompt lookup" in methods:
        lookup = stock_llama(path, args.threads, "q8_0", True)
        runners["llama.cpp prompt lookup"] = lambda p: stock_generate(lookup, p, args.max_new_tokens, eos)
    steps: dict[str, list[int]] = {m: [] for m in methods}

    def specx_runner(name, engine, cost):
        drafter, acceptance = SuffixDrafter(max_spec_factor=4.0), AcceptanceModel()
        prefixes = engine.new_prefix_cache(8192)
        engine.tune_threads(cost.shape if cost is not None else None, say)
        settings = Decoding(max_new_tokens=args.max_new_tokens, eos_token_ids=eos)

        def run(prompt):
            run = collect(generate(engine, prompt, drafter, settings, cost=cost, acceptance=acceptance,
                                   prefix_cache=prefixes))
            steps[name].append(run.stats.steps)
            return run.tokens
        return run

    if "specx llama.cpp" in methods:
        net = LlamaModel(path, n_ctx=N_CTX, threads=args.threads)
        cost = model_cost(net, name, say)
        costs.append(cost)
        runners["specx llama.cpp"] = specx_runner("specx llama.cpp", net, cost)
    if "quantized plain" in methods or "specx quantized" in methods:
        quantized = QuantEngine(path, context=N_CTX)
        qprefixes = quantized.new_prefix_cache(8192)
        runners["quantized plain"] = lambda p: quantized.plain(p, args.max_new_tokens, eos, prefix_cache=qprefixes)
        cost = model_cost(quantized, name, say)
        costs.append(cost)
        runners["specx quantized"] = specx_runner("specx quantized", quantized, cost)
    if "specx transformers" in methods:
        import torch

        torch.set_grad_enabled(False)
        hf = TransformersEngine(load_model(name, specx_home() / "models")[0])
        cost = model_cost(hf, name, say)
        costs.append(cost)
        runners["specx transformers"] = specx_runner("specx transformers", hf, cost)
    auto = None
    if "specx auto" in methods:
        auto = resolve_backend(name, "auto", say)
        if auto == "llama.cpp":
            net = LlamaModel(path, n_ctx=N_CTX, threads=args.threads)
        elif auto == "quantized":
            net = QuantEngine(path, context=N_CTX)
        else:
            import torch

            torch.set_grad_enabled(False)
            net = TransformersEngine(load_model(name, specx_home() / "models")[0])
        cost = model_cost(net, name, say)
        costs.append(cost)
        runners["specx auto"] = specx_runner("specx auto", net, cost)

    outputs = {m: [] for m in methods}
    seconds = {m: [] for m in methods}
    say(f"running {', '.join(methods)} over {len(prompts)} requests ({args.warmup} untimed), taking turns ...")
    with progress() as bar:
        task = bar.add_task("requests x methods", total=len(prompts) * len(methods))
        for i, prompt in enumerate(prompts):
            for m in methods:
                t0 = time.perf_counter()
                out = runners[m](prompt)
                elapsed = time.perf_counter() - t0
                outputs[m].append(out)
                seconds[m].append(elapsed)
                bar.advance(task)
    for cost in costs:
        keep_cost(cost)
    timed = range(args.warmup, len(prompts))
    ref = "llama.cpp" if "llama.cpp" in methods else methods[0]
    own_plain = {"specx llama.cpp": "llama.cpp", "specx quantized": "quantized plain", "llama.cpp": "llama.cpp",
                 "llama.cpp prompt lookup": "llama.cpp", "llama.cpp f16": "llama.cpp f16",
                 "quantized plain": "quantized plain",
                 "specx auto": {"llama.cpp": "llama.cpp", "quantized": "quantized plain"}.get(auto or "")}
    rows = {}
    for m in methods:
        tokens = sum(len(outputs[m][i]) for i in timed)
        secs = sum(seconds[m][i] for i in timed)
        plain = own_plain.get(m)
        rows[m] = {"tokens_per_s": tokens / secs if secs else 0.0, "tokens": tokens, "seconds": secs, "calls": len(timed),
                   "own_plain": plain if plain in outputs else None,
                   "identical_calls": (sum(outputs[m][i] == outputs[plain][i] for i in timed)
                                       if plain in outputs else None)}
        if steps[m]:
            rows[m]["tokens_per_step"] = tokens / sum(steps[m][i] for i in timed)
    base = rows[ref]["tokens_per_s"]
    for m in methods:
        rows[m]["vs_llama_cpp"] = rows[m]["tokens_per_s"] / base if base else 0.0
        per_call = [len(outputs[m][i]) / seconds[m][i] / (len(outputs[ref][i]) / seconds[ref][i])
                    for i in timed if seconds[m][i] and seconds[ref][i] and outputs[ref][i]]
        rows[m]["median_call_ratio"] = statistics.median(per_call) if per_call else 0.0
    if args.json:
        print(json.dumps({"cpu": cpu.model_name(), "isa": cpu.instruction_sets(), "workload": workload, "model": name,
                          "auto": auto,
                          "methods": rows, "requests": args.requests, "warmup": args.warmup, "shots": args.shots,
                          "max_new_tokens": args.max_new_tokens, "threads": args.threads, "reference": ref}, indent=2))
        return
    print(f"{'method':<26}{'tokens/s':>10}{'vs ' + ref:>14}{'per call':>10}{'tokens/step':>13}"
          f"{'identical to own plain':>24}")
    for m, r in rows.items():
        per_step = f"{r['tokens_per_step']:>13.2f}" if "tokens_per_step" in r else f"{'-':>13}"
        same = (f"{r['identical_calls']}/{r['calls']} ({r['own_plain']})" if r["own_plain"] and r["own_plain"] != m
                else "(reference)" if r["own_plain"] == m else "-")
        print(f"{m:<26}{r['tokens_per_s']:>10.1f}{r['vs_llama_cpp']:>13.2f}x{r['median_call_ratio']:>9.2f}x"
              f"{per_step}{same:>24}")
    print(f"{name}, {workload}, {args.requests} timed requests; tokens/s include each prompt's prefill; per call: the "
          f"median of the calls' ratios; identical: outputs equal to the same engine's plain decoding (engines round "
          f"differently, so two engines' greedy outputs may part ways; each is lossless against its own)")


if __name__ == "__main__":
    main()
