"""Concurrent clients against `specx serve` and llama.cpp's server: aggregate tokens/s and latency.

C clients (1, 2, 4, 8 by default) send the same requests at once, each its next one as soon as its
last is answered: single-turn text-to-SQL over Spider dev, the system message holding the schema
and three question/SQL examples, greedy, through the official openai client. Each C gets a fresh
server (a new empty store, so that no run drafts from another's outputs) and one warm-up request.
The table gives the aggregate completion tokens per second (all tokens over the wall time), the
p50/p95 latency of a request, whether every output equals the C = 1 run's of the same server, and
the server's peak resident memory; beside specx, llama-server with `-np C` (continuous batching,
C slots) on the same GGUF where its binary is found (examples/model_ladder.py builds it).

    .venv/bin/python examples/concurrency_bench.py                   # built-in model, C = 1 2 4 8
    .venv/bin/python examples/concurrency_bench.py --clients 1 4 --requests 12 --json

Needs ../shared/agent-data/text2sql-spider-dail-spider2 beside the checkout, or --spider FOLDER.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

from specx.bench.task_servers import peak_rss

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_bench import DEFAULT_SPIDER, LocalServer, free_port, launch, spider_databases  # noqa: E402

LLAMA_SERVER = Path.home() / ".cache" / "specx" / "llama.cpp" / "build" / "bin" / "llama-server"
SKIP_DATABASES = 8  # the databases serve_bench's conversations use come first: start after them


def requests(folder: Path, num: int, per_db: int = 4, shots: int = 3) -> list[list[dict]]:
    """`num` chat requests, `per_db` questions per database after its `shots` examples."""
    out: list[list[dict]] = []
    for i, (_, system, rest) in enumerate(spider_databases(folder, shots)):
        if i < SKIP_DATABASES or len(rest) < per_db:
            continue
        for q in rest[:per_db]:
            out.append([{"role": "system", "content": system}, {"role": "user", "content": q["question"]}])
            if len(out) == num:
                return out
    return out


def drive(url: str, model: str, reqs: list[list[dict]], clients: int, max_tokens: int) -> dict:
    """Every request, `clients` at a time; texts in request order, latencies, tokens, wall time."""
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    def one(messages: list[dict]) -> tuple[str, int, float]:
        t0 = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0)
        return answer.choices[0].message.content or "", answer.usage.completion_tokens, time.perf_counter() - t0

    one(reqs[-1][:1] + [{"role": "user", "content": "List every table."}])  # warm-up, not measured
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, reqs))
    wall = time.perf_counter() - started
    latencies = sorted(r[2] for r in results)
    tokens = sum(r[1] for r in results)
    return {"texts": [r[0] for r in results], "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "p50_s": round(statistics.median(latencies), 3),
            "p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3)}


class LlamaServer:
    """llama.cpp's server on a free loopback port with `slots` parallel sequences."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int, workdir: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc = launch([str(binary), "-m", str(gguf), "--port", str(port), "-np", str(slots), "-c",
                            str(context * slots), "-t", str(threads), "--no-webui"],
                           workdir / f"llama-server-{port}.log", f"http://127.0.0.1:{port}/health", "llama-server")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="what specx serve runs (and the GGUF llama-server "
                        "runs: the built-in model's file, or --gguf)")
    parser.add_argument("--gguf", type=Path, help="the GGUF for llama-server (default: the built-in model's)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="llama-server's context per slot")
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--servers", nargs="+", default=["specx", "llama-server"], choices=["specx", "llama-server"])
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `specx serve` argument (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    reqs = requests(args.spider, args.requests)
    if len(reqs) < args.requests:
        sys.exit(f"error: {args.spider} holds only {len(reqs)} such requests")
    gguf = args.gguf
    if gguf is None:
        from specx.core.model.load import builtin_gguf

        gguf = builtin_gguf(args.model)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.servers:
            if name == "llama-server" and not args.llama_server.exists():
                print(f"llama-server: no binary at {args.llama_server} (examples/model_ladder.py builds it); "
                      "its rows are skipped", file=sys.stderr)
                continue
            first: list[str] | None = None
            for c in args.clients:
                print(f"{name}, {c} client(s) ...", file=sys.stderr)
                if name == "specx":
                    server = LocalServer(["--model", args.model, *args.serve_arg], None, work)
                else:
                    server = LlamaServer(args.llama_server, gguf, c, args.context, 2, work)
                try:
                    run = drive(server.url, args.model if name == "specx" else "model", reqs, c, args.max_tokens)
                    peak = peak_rss(server.proc.pid)
                    run["peak_rss_mb"] = peak / 2**20 if peak is not None else None
                finally:
                    server.stop()
                texts = run.pop("texts")
                first = texts if first is None else first
                run["identical"] = sum(a == b for a, b in zip(texts, first))
                base = next((r for r in rows if r["server"] == name), run)
                run["vs_c1"] = round(run["tokens_per_s"] / base["tokens_per_s"], 2)
                rows.append({"server": name, "clients": c, **run})
                print(json.dumps(rows[-1]), file=sys.stderr)
    if args.json:
        print(json.dumps({"requests": len(reqs), "max_tokens": args.max_tokens, "rows": rows}, indent=1))
        return
    print(f"{len(reqs)} text-to-SQL requests, 3-shot, {args.max_tokens} tokens at most, greedy")
    print(f"{'server':<13} {'C':>2} {'tok/s':>8} {'vs C=1':>7} {'p50 s':>7} {'p95 s':>7} {'identical':>10} {'peak RSS MB':>12}")
    for r in rows:
        print(f"{r['server']:<13} {r['clients']:>2} {r['tokens_per_s']:>8.1f} {r['vs_c1']:>7.2f} {r['p50_s']:>7.2f} "
              f"{r['p95_s']:>7.2f} {r['identical']:>5}/{len(reqs):<4} {r['peak_rss_mb'] or 0:>12.0f}")


if __name__ == "__main__":
    main()
