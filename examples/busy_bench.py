"""`specx serve` on a busy machine: start-up time, and specx against its own plain server, side by side.

Spins `--load-per-core` busy processes per core (as other agents, tests and builds do), then, under
that load: starts `specx serve` and times it to /health 200, stops it and times a restart on the
same store, starts a `--no-speculation` server beside it, and sends the same 3-shot Spider
text-to-SQL completions (greedy) to both, taking turns request by request, so that the load weighs
on both alike. Prints a table (or --json): ready times, tokens/s of each, the speedup (total, and
the median of the per-request ratios), identical outputs. `--load-per-core 0`: the quiet machine.

    .venv/bin/python examples/busy_bench.py --requests 12 --warmup 4
    .venv/bin/python examples/busy_bench.py --load-per-core 0 --json

Needs ../shared/agent-data/text2sql-spider-dail-spider2 beside the checkout, or --spider FOLDER.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_bench import LocalServer  # noqa: E402
from text2sql_bench import DEFAULT_SPIDER, spider_prompts  # noqa: E402

SPIN = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end: pass"


def spin(num: int, limit_s: float) -> list[subprocess.Popen]:
    """`num` processes that keep a core busy for at most `limit_s` seconds (they stop by themselves)."""
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(limit=limit_s)]) for _ in range(num)]


def started(args: list[str], workdir: Path) -> tuple[LocalServer, float]:
    t0 = time.perf_counter()
    server = LocalServer(args, None, workdir)
    return server, time.perf_counter() - t0


def complete(client: OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    t0 = time.perf_counter()
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.completion_tokens, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-per-core", type=int, default=2, help="busy processes per core (0: a quiet machine)")
    parser.add_argument("--requests", type=int, default=12, help="timed requests to each server")
    parser.add_argument("--warmup", type=int, default=4, help="requests sent to each first, untimed")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--shots", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--limit-s", type=float, default=3600, help="the busy processes stop after this long anyway")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no spider_dev.json in {args.spider} (pass --spider FOLDER)")
    prompts = spider_prompts(args.spider, args.warmup + args.requests, args.shots)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    spinners = spin(args.load_per_core * (os.cpu_count() or 1), args.limit_s)
    servers: list[LocalServer] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            store = ["--db", str(work / "specx.db"), "--model", args.model]
            say(f"{len(spinners)} busy processes; starting specx serve ...")
            server, start_s = started(store, work)
            say(f"ready in {start_s:.1f} s; restarting it ...")
            server.stop()
            spec, restart_s = started(store, work)
            servers.append(spec)
            say(f"ready in {restart_s:.1f} s; starting specx serve --no-speculation beside it ...")
            plain, plain_start_s = started(["--db", str(work / "plain.db"), "--model", args.model,
                                            "--no-speculation"], work)
            servers.append(plain)
            clients = {name: OpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=1800)
                       for name, s in (("specx", spec), ("plain", plain))}
            rows = []
            for i, prompt in enumerate(prompts):
                row = {}
                for name in ("plain", "specx"):  # taking turns: the load weighs on both alike
                    row[name] = complete(clients[name], args.model, prompt, args.max_tokens)
                if i >= args.warmup:
                    rows.append(row)
                say(f"request {i + 1}/{len(prompts)}{' (warm-up)' if i < args.warmup else ''}: "
                    f"plain {row['plain'][1] / row['plain'][2]:.1f} tokens/s, "
                    f"specx {row['specx'][1] / row['specx'][2]:.1f} tokens/s")
            logs = {name: s.log.read_text() for name, s in (("specx", spec), ("plain", plain))}
    finally:
        for s in servers:
            s.stop()
        for p in spinners:
            p.kill()
    total = {name: (sum(r[name][1] for r in rows), sum(r[name][2] for r in rows)) for name in ("plain", "specx")}
    rate = {name: tokens / seconds for name, (tokens, seconds) in total.items()}
    ratios = [(r["specx"][1] / r["specx"][2]) / (r["plain"][1] / r["plain"][2]) for r in rows]
    result = {"load_per_core": args.load_per_core, "busy_processes": len(spinners), "requests": len(rows),
              "max_tokens": args.max_tokens, "shots": args.shots,
              "ready_s": {"start": round(start_s, 1), "restart": round(restart_s, 1),
                          "plain_start": round(plain_start_s, 1)},
              "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
              "speedup": round(rate["specx"] / rate["plain"], 3),
              "median_request_speedup": round(statistics.median(ratios), 3),
              "request_speedups": [round(x, 2) for x in ratios],
              "identical": sum(r["specx"][0] == r["plain"][0] for r in rows),
              "threads_switches": logs["specx"].count("threads:"),
              "guard_lines": [line.split("specx: ", 1)[-1] for line in logs["specx"].splitlines() if "drafts " in line]}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"busy processes: {len(spinners)} ({args.load_per_core} per core)")
    print(f"specx serve ready: start {start_s:.1f} s, restart {restart_s:.1f} s "
          f"(--no-speculation: {plain_start_s:.1f} s)")
    print(f"{'server':<28}{'tokens/s':>10}")
    print(f"{'specx serve --no-speculation':<28}{rate['plain']:>10.2f}")
    print(f"{'specx serve':<28}{rate['specx']:>10.2f}")
    print(f"speedup {result['speedup']:.2f}x (median of per-request ratios {result['median_request_speedup']:.2f}x); "
          f"identical outputs {result['identical']}/{len(rows)}")


if __name__ == "__main__":
    main()
