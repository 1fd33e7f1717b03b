"""Check the predictor against full replays on every workload a store holds (docs/predict.md).

A workload is a selection `specx replay` can make: every call; each log format (--format); each
agent role (--agent); each model (--llm) and each log file or folder (--source) with at least
--min-calls calls. Selections holding the same calls are reported once. For each, back to back
in one process (the tokenizer loaded once, the compiled kernels warm):

- predicted: what `specx entropy` predicts (core/predict/estimate.py): --sample-calls draws (default 200),
  weighted (chance ~ sqrt of output length, the default) and every call alike, with the 95%
  interval; the seconds of the weighted prediction (outputs read, draws, prompts of the drawn
  calls rendered, the walk with the history);
- replayed: `specx replay --no-baselines` on the same calls (prompts of every call rendered, the
  replay), its tokens per step and seconds;
- over --seeds draws (default 200), from the full replay's own per-call figures (a sampled call
  measures exactly what the full replay measures, tests/test_predict.py): the largest and the
  root-mean-square error of each sampling and how often its interval holds the replay's figure;
- entropy_bits (`specx entropy`), for comparison;
- with --speedup: the predicted speedup per cost curve (flat, cpu) against `specx replay`'s
  projection from every call (slow: every call replayed again with drafts cut on the cpu curve).

Then Spearman's rank correlation, across workloads, of the predictions and of the entropy (its
negative: lower entropy should mean more tokens per step) with the replays' figures.

    .venv/bin/python examples/predict_check.py --db /work/scratch/predict/agents.db --speedup --json
    .venv/bin/python examples/predict_check.py --logs ../shared/agent-data   # ingests into a temporary store
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from specx import predict as predict_lib
from specx.home import specx_home
from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
from specx.core.predict import methods as replay_lib
from specx.core.predict.entropy import empirical_entropy
from specx.core.predict.sampling import combined_ratio, draw_stratified
from specx.store.db import Store
from specx.store.prompts import prompt_tokens
from specx.store.selection import select_calls


def workloads(calls: list, min_calls: int) -> list[tuple[str, list]]:
    """(name, calls in stored order) of every workload, distinct call sets only."""
    out: list[tuple[str, list]] = [("all", calls)]
    for attr, option in (("format", "--format"), ("agent", "--agent"), ("model", "--llm"), ("source", "--source")):
        counts = Counter(getattr(c, attr) for c in calls if getattr(c, attr))
        for value, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if n >= (1 if attr in ("format", "agent") else min_calls):
                out.append((f"{option} {value}", [c for c in calls if getattr(c, attr) == value]))
    folders = Counter(str(Path(c.source).parent) for c in calls)
    for folder, n in sorted(folders.items(), key=lambda kv: (-kv[1], kv[0])):
        if n >= min_calls:
            out.append((f"--source {folder}/", [c for c in calls if str(Path(c.source).parent) == folder]))
    seen: dict[tuple, str] = {}
    unique = []
    for name, members in out:
        key = tuple(c.id for c in members)
        if key in seen:
            continue
        seen[key] = name
        unique.append((name, members))
    return unique


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):
            tied = x == value
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def seed_errors(curve: list[tuple[int, int]], strata: list[str], n: int, power: float, seeds: int) -> dict[str, float]:
    """Errors of the estimate over `seeds` draws (within each stratum, as `specx entropy` draws by
    format), from the full replay's per-call (tokens, steps)."""
    tokens = np.array([t for t, _ in curve], dtype=float)
    steps = np.array([s for _, s in curve], dtype=float)
    truth = tokens.sum() / steps.sum()
    sizes = {key: strata.count(key) for key in set(strata)}
    errors, held = [], 0
    for seed in range(seeds):
        parts = draw_stratified(tokens.astype(int).tolist(), strata, n, seed, power)
        e = combined_ratio([(np.array(p.weights) * tokens[list(p.hits)], np.array(p.weights) * steps[list(p.hits)],
                             None if p.population is None else sizes[key], p.exhaustive) for key, p in parts.items()])
        errors.append(e.value / truth - 1)
        held += e.low is not None and e.low <= truth <= e.high
    errors = np.abs(errors)
    return {"max_abs_error": float(errors.max()), "rms_error": float(np.sqrt((errors ** 2).mean())),
            "coverage": held / seeds}


def check(store: Store, tok: Any, tokenizer_id: int, name: str, calls: list, args: argparse.Namespace,
          curves: list) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name, "calls": len(calls)}
    sample_calls = args.sample_calls if args.sample_calls < len(calls) else None  # smaller: every call, exactly
    predicted = {}
    for sampling in ("weighted", "calls"):
        t0 = time.perf_counter()
        result = predict_lib.predict_selection(store, tok, tokenizer_id, calls, by="format", curves=[],
                                               sample_calls=sample_calls, seed=args.seed, sampling=sampling)
        seconds = time.perf_counter() - t0
        predicted[sampling] = result
        overall = result["overall"]
        row[f"predicted_{sampling}"] = overall["predicted_tokens_per_step"]
        row[f"predicted_{sampling}_low"] = overall["predicted_tokens_per_step_low"]
        row[f"predicted_{sampling}_high"] = overall["predicted_tokens_per_step_high"]
        row[f"sample_calls_{sampling}"] = overall["sample_calls"]
        row[f"predict_seconds_{sampling}"] = seconds
    row["exhaustive"] = predicted["weighted"]["sample"]["exhaustive"]
    t0 = time.perf_counter()
    prompts = prompt_tokens(store, tok, calls, predict_lib.REPLAY_DEFAULTS["prompt_window"])
    outputs = [store.call_tokens(c.id, tokenizer_id) for c in calls]
    full = replay_lib.run_replay(calls, prompts, outputs, [], dict(predict_lib.REPLAY_DEFAULTS), "format", ["specx"])
    row["replay_seconds"] = time.perf_counter() - t0
    overall = full.to_json()["overall"]
    row["tokens"] = overall["output_tokens"]
    row["replayed"] = truth = overall["tokens_per_step"]
    row["time_ratio"] = row["predict_seconds_weighted"] / row["replay_seconds"]
    for sampling in ("weighted", "calls"):
        row[f"error_{sampling}"] = row[f"predicted_{sampling}"] / truth - 1
        low, high = row[f"predicted_{sampling}_low"], row[f"predicted_{sampling}_high"]
        row[f"in_interval_{sampling}"] = None if low is None else bool(low - 1e-9 <= truth <= high + 1e-9)
        if not row["exhaustive"] and args.seeds:
            power = predict_lib.SAMPLINGS[sampling]
            row[f"seeds_{sampling}"] = seed_errors(full["curve"]["specx"], [c.group("format") for c in calls],
                                                   args.sample_calls, power, args.seeds)
    row["entropy_bits"] = empirical_entropy(outputs, max_depth=64).entropy_bits
    if args.speedup:
        t0 = time.perf_counter()
        guess = predict_lib.predict_selection(store, tok, tokenizer_id, calls, by="format", curves=curves,
                                              sample_calls=sample_calls, seed=args.seed, sampling="weighted")
        row["predict_speedup_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        projection = predict_lib.project_replay(calls, prompts, outputs, warm=[],
                                                params=dict(predict_lib.REPLAY_DEFAULTS), by="format",
                                                curves=curves, result=full)
        row["projection_seconds"] = time.perf_counter() - t0
        row["predicted_speedup"] = guess["overall"]["predicted_speedup"]
        row["projected_speedup"] = projection["overall"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, help="The store (with --logs: created there if missing).")
    parser.add_argument("--logs", type=Path, help="Ingest these logs first (into a temporary store without --db).")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--sample-calls", type=int, default=predict_lib.DEFAULT_SAMPLE_CALLS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=200, help="Draws per workload for the error spread (0: none).")
    parser.add_argument("--min-calls", type=int, default=100, help="Smallest model or source workload.")
    parser.add_argument("--speedup", action="store_true", help="Also check the predicted speedups (slow).")
    parser.add_argument("--only", action="append", help="Only workloads whose name contains this (repeatable).")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer, specx_home() / "models")
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "agents.db"
        if args.logs is not None:
            from specx.store.ingest import Tokenizer, find_inputs, ingest

            with Store(db) as store:
                ingest(store, find_inputs([args.logs], None),
                       Tokenizer(args.tokenizer, lambda: tok, tokenizer_fingerprint))
        elif not db.exists():
            sys.exit(f"no store at {db} (pass --db or --logs)")
        curves = predict_lib.cost_curves(None)
        rows = []
        with Store(db) as store:
            tokenizer_id = store.tokenizer_id(tokenizer_fingerprint(tok))
            calls = select_calls(store, tokenizer_id)
            replay_lib.run_replay(calls[:2], prompt_tokens(store, tok, calls[:2], 64),
                                  [store.call_tokens(c.id, tokenizer_id) for c in calls[:2]], [],
                                  dict(predict_lib.REPLAY_DEFAULTS), "format", ["specx"])  # compile, load
            for name, members in workloads(calls, args.min_calls):
                if args.only and not any(o in name for o in args.only):
                    continue
                row = check(store, tok, tokenizer_id, name, members, args, curves)
                rows.append(row)
                print(f"{name}: {row['calls']} calls, predicted {row['predicted_weighted']:.3f} "
                      f"({row['error_weighted']:+.1%}), replayed {row['replayed']:.3f}; "
                      f"{row['predict_seconds_weighted']:.2f} s vs {row['replay_seconds']:.2f} s", file=sys.stderr)
    sampled = [r for r in rows if not r["exhaustive"]]
    summary: dict[str, Any] = {"workloads": len(rows), "sampled_workloads": len(sampled)}
    for which, part in (("all", rows), ("sampled", sampled)):
        if len(part) >= 3:
            truth = [r["replayed"] for r in part]
            summary[f"spearman_predicted_{which}"] = spearman([r["predicted_weighted"] for r in part], truth)
            summary[f"spearman_predicted_calls_{which}"] = spearman([r["predicted_calls"] for r in part], truth)
            summary[f"spearman_entropy_{which}"] = spearman([-r["entropy_bits"] for r in part], truth)
    summary["max_abs_error_weighted"] = max(abs(r["error_weighted"]) for r in rows)
    summary["max_abs_error_calls"] = max(abs(r["error_calls"]) for r in rows)
    largest = max(rows, key=lambda r: r["tokens"])
    summary["largest"] = {k: largest[k] for k in ("workload", "tokens", "predict_seconds_weighted", "replay_seconds",
                                                  "time_ratio")}
    report = {"sample_calls": args.sample_calls, "seed": args.seed, "seeds": args.seeds, "summary": summary,
              "workloads": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    lines = ["| workload | calls | tokens | replayed | predicted | 95% interval | error | largest error over seeds: "
             "weighted / calls alike | interval held | entropy bits | predict s | replay s |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["workloads"]:
        exact = r["exhaustive"]
        interval = "exact" if exact else (
            "-" if r["predicted_weighted_low"] is None
            else f"{r['predicted_weighted_low']:.2f}-{r['predicted_weighted_high']:.2f}")
        seeds, alike = r.get("seeds_weighted"), r.get("seeds_calls")
        spread = "-" if exact or not seeds else f"{seeds['max_abs_error']:.1%} / {alike['max_abs_error']:.1%}"
        held = "-" if exact or not seeds else f"{seeds['coverage']:.0%}"
        lines.append(f"| {short(r['workload'])} | {r['calls']:,} | {r['tokens']:,} | {r['replayed']:.3f} | "
                     f"{r['predicted_weighted']:.3f} | {interval} | {r['error_weighted']:+.1%} | {spread} | {held} | "
                     f"{r['entropy_bits']:.3f} | {r['predict_seconds_weighted']:.2f} | {r['replay_seconds']:.2f} |")
    with_speedup = [r for r in report["workloads"] if "predicted_speedup" in r]
    if with_speedup:
        lines += ["", "| workload | curve | predicted x plain | projected x plain (every call) | error | "
                      "predicted x prompt lookup | projected | error |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in with_speedup:
            for curve, got in r["predicted_speedup"].items():
                want = r["projected_speedup"][curve]
                cells = []
                for key in ("vs_plain", "vs_prompt_lookup"):
                    g, w = got.get(key), want.get(key)
                    cells += ["-", "-", "-"] if g is None or w is None else [f"{g:.2f}x", f"{w:.2f}x", f"{g / w - 1:+.1%}"]
                lines.append(f"| {short(r['workload'])} | {curve} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(json.dumps(report["summary"], indent=2))
    return "\n".join(lines)


def short(name: str) -> str:
    """A workload's name without the folder the logs were ingested from."""
    return re.sub(r"^(--source )\S*?agent-data/", r"\1", name)


if __name__ == "__main__":
    main()
