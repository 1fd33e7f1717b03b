"""Is the successor table warm after a restart? `specx serve` answers the same requests before and
after a restart on the same store, and once more on a fresh store: tokens per verification step.

A server on a fresh store answers warm-up requests, then the measured ones twice, and stops
(SIGTERM: it persists its index and its successor table); "before" is the second pass, when the
table has seen the measured requests once. A second server on that store answers the measured
requests again ("after_restart"): its table came from the store, and it has seen them just as
often. A third, on a fresh store, answers them with an empty table ("cold"). The issue's target
(issue 41): after the restart, tokens per step within 3% of before it.

The drafter is the table alone by default (`--drafter table`), the part a restart could lose:
the suffix index's persistence is tested on its own (tests/test_serve_lifecycle.py). Greedy
decoding, so every run must answer identically (checked).

    .venv/bin/python examples/restart_bench.py --warmup 16 --requests 8 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_bench import QUESTIONS  # noqa: E402
from serve_bench import LocalServer  # noqa: E402


def ask_all(url: str, model: str, questions: list[str], max_tokens: int, label: str) -> list[dict]:
    """Each question as a one-turn chat, greedy, one at a time: the answer and its steps."""
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    rows = []
    for i, question in enumerate(questions):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, temperature=0)
        stats = (answer.model_extra or {}).get("specx", {})
        rows.append({"text": answer.choices[0].message.content, "tokens": answer.usage.completion_tokens,
                     "steps": stats.get("steps")})
        print(f"\r{label}: {i + 1}/{len(questions)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return rows


def per_step(rows: list[dict]) -> float:
    steps = sum(r["steps"] or 0 for r in rows)
    return sum(r["tokens"] for r in rows) / steps if steps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=16, help="requests before the measured ones, first server only")
    parser.add_argument("--requests", type=int, default=8, help="the measured requests")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--drafter", default="table", help="suffix, table or hybrid (specx serve --drafter)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.warmup + args.requests > len(QUESTIONS):
        sys.exit(f"error: {len(QUESTIONS)} questions: --warmup + --requests must not exceed that")
    measured, warmup = QUESTIONS[:args.requests], QUESTIONS[args.requests:args.requests + args.warmup]
    flags = ["--model", args.model, "--drafter", args.drafter]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "kept.db"
        for name, store, questions in (("before", db, warmup + measured + measured), ("after_restart", db, measured),
                                       ("cold", Path(tmp) / "fresh.db", measured)):
            print(f"{name}: starting specx serve --drafter {args.drafter} on {store.name}", file=sys.stderr)
            server = LocalServer(flags, None, Path(tmp), db=store)
            try:
                rows = ask_all(server.url, args.model, questions, args.max_tokens, name)
            finally:
                server.stop()
            runs[name] = rows[-len(measured):]
    texts = [r["text"] for r in runs["before"]]
    out = {"drafter": args.drafter, "warmup": args.warmup, "requests": args.requests, "max_tokens": args.max_tokens,
           "tokens_per_step": {name: round(per_step(rows), 3) for name, rows in runs.items()},
           "identical": all([r["text"] for r in rows] == texts for rows in runs.values())}
    out["after_vs_before"] = round(out["tokens_per_step"]["after_restart"] / out["tokens_per_step"]["before"], 3)
    out["cold_vs_before"] = round(out["tokens_per_step"]["cold"] / out["tokens_per_step"]["before"], 3)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{'run':<14} {'tokens/step':>11}")
    for name, value in out["tokens_per_step"].items():
        print(f"{name:<14} {value:>11.3f}")
    print(f"after the restart / before it: {out['after_vs_before']}x; cold / before: {out['cold_vs_before']}x; "
          f"identical answers: {'yes' if out['identical'] else 'NO'}")


if __name__ == "__main__":
    main()
