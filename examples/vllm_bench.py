"""specx as vLLM's drafter against vLLM's own methods, on an agent-like workload.

Text-to-SQL requests over the Spider schemas (as examples/text2sql_bench.py builds them), or with
--db the prompts of stored agent calls (--format, --source, --agent; in stored order), greedy, split into a
history half and a timed half. One vLLM engine per method and concurrency, each in a
fresh process (in-process engine core, so the bench can time the drafter), the timed half measured:

    none               no speculation
    ngram              vLLM's prompt lookup (prompt_lookup_min/max 5, vLLM's defaults)
    specx_cold         specx with an empty store
    suffix             ArcticInference's suffix tree after a restart: whatever it saw of the history
                       half died with the engine, so it starts cold (run as such)
    specx_warm         specx after a restart: the store holds what the same model answered to the
                       history half at the same concurrency (served once by specx, recorded, then the
                       engine exited)
    suffix_inprocess   history half then timed half in one engine
    specx_inprocess    the same with specx (empty store at start)

Every method's outputs are compared with `none`'s at the same concurrency. Counts come from vLLM's
spec-decode counters; steps are the request-steps the proposer saw (one per forward pass that gave
a request tokens; specx's plugin times vLLM's proposers in the engine's worker when
SPECX_PROPOSER_STATS names a file), so accepted_per_step = accepted tokens / steps. Needs vLLM
(`make bench-vllm` builds .venv-vllm and runs this); the reference for `suffix` is built on first
use (examples/build_reference.sh).

    .venv-vllm/bin/python examples/vllm_bench.py --json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SPIDER = HERE.parent.parent / "shared" / "agent-data" / "text2sql-spider-dail-spider2"
METHODS = ("none", "ngram", "specx_cold", "suffix", "specx_warm", "suffix_inprocess", "specx_inprocess")


def spec_config(method: str, k: int) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 5, "prompt_lookup_max": 5}
    return {"method": "suffix", "num_speculative_tokens": k}  # specx_* too: SPECX_DB makes it specx's


# ----------------------------------------------------------------------------- one engine (child process)

def run_engine(args: argparse.Namespace) -> dict:
    """One engine: optionally the history half (untimed), then the timed half, measured."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    history, timed_prompts = prompts["history"], prompts["timed"]
    llm = LLM(args.model, speculative_config=spec_config(args.run, args.k), max_model_len=args.max_model_len,
              enforce_eager=True, dtype="float32", max_num_seqs=args.concurrency, disable_log_stats=False, seed=0,
              gpu_memory_utilization=args.memory_fraction)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    def serve(batch: list[str | list[int]]) -> list[list[int]]:
        out = []
        for i in range(0, len(batch), args.concurrency):
            part = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in batch[i : i + args.concurrency]]
            out += [list(o.outputs[0].token_ids) for o in llm.generate(part, params, use_tqdm=False)]
        return out

    if args.history:
        serve(history)
    before, timed_from = counters(llm), time.time()
    t0 = time.perf_counter()
    outputs = serve(timed_prompts)
    seconds = time.perf_counter() - t0
    after = counters(llm)
    num_tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "tokens": num_tokens, "seconds": seconds,
            "tokens_per_s": num_tokens / seconds if seconds > 0 else 0.0, "timed_from": timed_from,
            "draft_tokens": after["drafted"] - before["drafted"], "accepted_tokens": after["accepted"] - before["accepted"],
            "requests": len(outputs)}


def counters(llm) -> dict:
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {"drafted": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(getattr(metric, "value", 0))
    return out


# ----------------------------------------------------------------------------- the orchestra (parent)

def child(args: argparse.Namespace, method: str, concurrency: int, prompts: Path, store: Path | None,
          history: bool) -> dict:
    env = dict(os.environ)
    env.pop("SPECX_DB", None)
    stats_file = Path(tempfile.mkdtemp(prefix="vllm-bench-stats-")) / "proposer.json"
    env["SPECX_PROPOSER_STATS"] = str(stats_file)  # the specx plugin times the proposer in the engine's worker
    if store is not None:
        env["SPECX_DB"] = str(store)
        env["SPECX_SYNC_S"] = "0"
    cmd = [sys.executable, __file__, "--run", method, "--prompts", str(prompts), "--model", args.model,
           "--concurrency", str(concurrency), "--k", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
           "--max-model-len", str(args.max_model_len), "--memory-fraction", str(args.memory_fraction)]
    if history:
        cmd.append("--history")
    print(f"vllm_bench: {method} at concurrency {concurrency}{' (history half first)' if history else ''}",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        proc = subprocess.run(cmd + ["--out", out.name], env=env, stdout=None if args.verbose else subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout or "")[-3000:]
            raise SystemExit(f"vllm_bench: the {method} engine failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(Path(out.name).read_text())
    timed_from = result.pop("timed_from")
    calls = [c for c in json.loads(stats_file.read_text()) if c[0] >= timed_from] if stats_file.is_file() else []
    steps = sum(c[2] for c in calls)
    result["steps"] = steps or result["tokens"]  # no proposer: one step per token
    result["accepted_per_step"] = result["accepted_tokens"] / result["steps"]
    result["draft_us_per_step"] = 1e6 * sum(c[1] for c in calls) / steps if steps else 0.0
    print(f"vllm_bench:   {result['tokens_per_s']:.1f} tokens/s, {result['accepted_per_step']:.2f} accepted/step "
          f"({time.perf_counter() - t0:.0f} s with start-up)", file=sys.stderr, flush=True)
    return result


def bench(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(HERE))
    from text2sql_bench import spider_prompts

    prompts = stored_prompts(args) if args.db else spider_prompts(Path(args.spider), 2 * args.requests, args.shots)
    if len(prompts) < 2 * args.requests:
        raise SystemExit(f"vllm_bench: only {len(prompts)} prompts in {args.db or args.spider}")
    history, timed = prompts[: args.requests], prompts[args.requests :]
    if any(m.startswith("suffix") for m in args.methods) and importlib.util.find_spec("arctic_inference") is None:
        print("vllm_bench: building the reference (ArcticInference's suffix tree) for `suffix`", file=sys.stderr)
        subprocess.run(["bash", str(HERE / "build_reference.sh"), sys.executable], check=True,
                       stdout=sys.stderr)  # its build log: stdout is the report (--json)
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    prompt_file = work / "prompts.json"
    prompt_file.write_text(json.dumps({"history": history, "timed": timed}))
    history_file = work / "history.json"
    history_file.write_text(json.dumps({"history": [], "timed": history}))
    report: dict = {"params": {k: getattr(args, k) for k in ("requests", "max_new_tokens", "k", "shots", "model", "db",
                                                              "format", "source", "agent")}}
    recorded: dict[int, list] = {}
    for c in args.concurrency:
        warm_store = work / f"warm-c{c}.db"
        if "specx_warm" in args.methods:
            # specx serves the history half once, at this concurrency, and records it; the engine exits. At
            # another concurrency the model's greedy answers can differ (batched arithmetic), and the
            # in-process methods see the answers of the concurrency they are timed at.
            recorded[c] = child(args, "specx_cold", c, history_file, warm_store, history=False)["outputs"]
        results = {}
        for m in args.methods:
            store = None
            if m.startswith("specx"):
                store = work / f"{m}-c{c}.db"
                if m == "specx_warm":
                    copy_store(warm_store, store)
            results[m] = child(args, m, c, prompt_file, store, history=m.endswith("inprocess"))
        base = results["none"]["outputs"] if "none" in results else None
        for r in results.values():
            outputs = r.pop("outputs")
            r["identical"] = sum(o == b for o, b in zip(outputs, base)) if base is not None else None
        ratios = {}
        for a, b in (("specx_warm", "suffix"), ("specx_inprocess", "suffix_inprocess"), ("specx_warm", "ngram"),
                     ("specx_cold", "suffix")):
            if a in results and b in results:
                ra, rb = results[a], results[b]
                ratios[f"{a}/{b}"] = {
                    "accepted_per_step": ra["accepted_per_step"] / rb["accepted_per_step"]
                    if rb["accepted_per_step"] else None,
                    "tokens_per_s": ra["tokens_per_s"] / rb["tokens_per_s"],
                    "draft_us_per_step": ra["draft_us_per_step"] / rb["draft_us_per_step"]
                    if rb["draft_us_per_step"] else None}
        entry = {"methods": results, "ratios": ratios}
        if c in recorded and args.concurrency[0] in recorded:  # the history's answers against the first concurrency's
            entry["history_identical_to_first_concurrency"] = sum(
                a == b for a, b in zip(recorded[c], recorded[args.concurrency[0]]))
        if c == args.concurrency[0]:
            report.update(entry | {"concurrency": c})
        else:
            report[f"concurrency_{c}"] = entry
    return report


def stored_prompts(args: argparse.Namespace) -> list[list[int]]:
    """The prompts of stored calls (in stored order) as the served model's tokens: agents' own requests."""
    from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
    from specx.store.db import Store
    from specx.store.prompts import prompt_tokens
    from specx.store.selection import select_calls

    tokenizer = load_tokenizer(args.model)
    with Store(Path(args.db)) as store:
        tid = store.tokenizer_id(tokenizer_fingerprint(tokenizer))
        if tid is None:
            raise SystemExit(f"vllm_bench: {args.db} holds no tokens of {args.model}'s tokenizer")
        calls = select_calls(store, tid, formats=args.format, sources=args.source, agents=args.agent,
                             limit=2 * args.requests)
        window = args.max_model_len - args.max_new_tokens - 1
        return [p[-window:].tolist() for p in prompt_tokens(store, tokenizer, calls, window)]


def copy_store(src: Path, dst: Path) -> None:
    """A consistent copy of a SQLite store (its WAL included)."""
    import sqlite3

    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


def print_table(report: dict) -> None:
    keys = ("tokens_per_s", "accepted_per_step", "draft_tokens", "accepted_tokens", "steps", "identical",
            "draft_us_per_step")
    sections = [(report.get("concurrency", 1), report)] + [
        (int(k.split("_")[1]), v) for k, v in report.items() if k.startswith("concurrency_")]
    for c, section in sections:
        print(f"\nconcurrency {c} ({report['params']['requests']} timed requests; higher tokens/s and accepted/step "
              f"are better)")
        print("| method | " + " | ".join(keys) + " |")
        print("|" + " --- |" * (len(keys) + 1))
        for name, r in section["methods"].items():
            cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
            print(f"| {name} | " + " | ".join(cells) + " |")
        for name, ratio in section["ratios"].items():
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v is not None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests in each half (history, timed)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens (the most a draft may have)")
    parser.add_argument("--shots", type=int, default=3, help="question/SQL examples in each prompt (0: none)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--model", default=None, help="an HF model folder (default: the built-in model, converted)")
    parser.add_argument("--spider", default=str(DEFAULT_SPIDER))
    parser.add_argument("--db", help="draw the prompts from this store's calls instead (stored agents' requests)")
    parser.add_argument("--format", action="append", help="with --db: log format(s) (swe-agent, ...)")
    parser.add_argument("--source", action="append", help="with --db: stored source(s)")
    parser.add_argument("--agent", action="append", help="with --db: agent role(s)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--memory-fraction", type=float, default=0.3, help="vLLM's gpu_memory_utilization (on "
                                                                           "CPU: the share of memory for KV)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="show the engines' logs")
    parser.add_argument("--run", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--history", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        args.concurrency = args.concurrency[0]
        Path(args.out).write_text(json.dumps(run_engine(args)))
        return
    if args.model is None:
        args.model = str(builtin_model_folder())
    report = bench(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


def builtin_model_folder() -> Path:
    """The built-in model as an HF folder (converted once from its GGUF, as specx does)."""
    from specx.home import specx_home
    from specx.core.model.load import DEFAULT_MODEL, load_model

    folder = specx_home() / "models" / DEFAULT_MODEL
    if not (folder / "model.safetensors").is_file():
        load_model(DEFAULT_MODEL, specx_home() / "models", device="cpu", kernels=False)
    return folder


if __name__ == "__main__":
    main()
