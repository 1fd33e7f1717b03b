"""`specx serve` on an agent-like workload, speculation on and off: latency per request and tokens/s.

The workload is a multi-turn text-to-SQL agent over the Spider dev set: one conversation per
database, the system message holds the schema and a few question/SQL examples (DAIL-SQL style),
each user turn asks a new question, and the model's answer goes back into the history, so every
request resends the whole conversation, as agents do. Greedy decoding through the official openai
client, one request at a time. The same conversations go to a server with speculation and to one
with `--no-speculation` (each started here with a fresh store, one after the other, or given by
URL); the outputs must be identical (lossless) and the table shows both side by side.

    .venv/bin/python examples/serve_bench.py --conversations 4 --turns 4 --max-tokens 48
    .venv/bin/python examples/serve_bench.py --spec-url http://127.0.0.1:8000/v1 --plain-url http://127.0.0.1:8001/v1

Needs ../shared/agent-data/text2sql-spider-dail-spider2 (spider_dev.json, spider_tables.json)
beside the checkout, or --spider FOLDER.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from openai import OpenAI

HERE = Path(__file__).resolve().parent
DEFAULT_SPIDER = HERE.parent.parent / "shared" / "agent-data" / "text2sql-spider-dail-spider2"
SYSTEM = ("You are a text-to-SQL agent. Answer each question with one SQLite query for the database below, "
          "in a ```sql block, and nothing else.\n\n")


def spider_databases(folder: Path, shots: int = 3) -> Iterator[tuple[str, str, list[dict]]]:
    """Each Spider dev database in order: (db_id, a system message with its schema and its first
    `shots` question/SQL examples, its other questions)."""
    dev = json.loads((folder / "spider_dev.json").read_text())
    schemas = {t["db_id"]: t for t in json.loads((folder / "spider_tables.json").read_text())}
    by_db: dict[str, list[dict]] = {}
    for item in dev:
        by_db.setdefault(item["db_id"], []).append(item)
    for db_id, items in by_db.items():
        schema = schemas[db_id]
        tables = [f"CREATE TABLE {name} ({', '.join(c for t, c in schema['column_names_original'] if t == i)});"
                  for i, name in enumerate(schema["table_names_original"])]
        examples = [f"Question: {ex['question']}\n```sql\n{ex['query'].strip()};\n```" for ex in items[:shots]]
        yield db_id, SYSTEM + "\n".join(tables) + "\n\nExamples:\n\n" + "\n\n".join(examples), items[shots:]


def conversations(folder: Path, num: int, turns: int, shots: int = 3) -> list[dict]:
    """`num` databases with at least shots + turns questions: schema + examples, then `turns` questions."""
    out = []
    for db_id, system, rest in spider_databases(folder, shots):
        if len(rest) < turns:
            continue
        out.append({"db_id": db_id, "system": system, "questions": [q["question"] for q in rest[:turns]]})
        if len(out) == num:
            break
    return out


def run_workload(client: OpenAI, model: str, convs: list[dict], max_tokens: int) -> list[dict]:
    """Every turn of every conversation, one request at a time; answers are fed back into the history."""
    rows = []
    for c, conv in enumerate(convs):
        messages = [{"role": "system", "content": conv["system"]}]
        for t, question in enumerate(conv["questions"]):
            messages.append({"role": "user", "content": question})
            t0 = time.perf_counter()
            answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0)
            seconds = time.perf_counter() - t0
            text = answer.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            stats = (answer.model_extra or {}).get("specx", {})
            rows.append({"conversation": c, "turn": t, "db_id": conv["db_id"], "text": text,
                         "prompt_tokens": answer.usage.prompt_tokens, "tokens": answer.usage.completion_tokens,
                         "seconds": seconds, "tokens_per_s": answer.usage.completion_tokens / seconds,
                         "steps": stats.get("steps"), "accepted": stats.get("accepted"),
                         "draft_seconds": stats.get("draft_seconds"), "verify_seconds": stats.get("verify_seconds")})
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], log_path: Path, health: str, what: str) -> subprocess.Popen:
    """`argv` in a subprocess writing to `log_path`, returned once GET `health` answers 200; the
    script exits with the log's tail if it dies or is not ready in 10 minutes."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: {what} exited:\n{log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    sys.exit(f"error: {what} did not start")


class LocalServer:
    """`specx serve` in a subprocess on a free loopback port, with its own copy of the store (or,
    given `db`, on that store itself: a restart)."""

    def __init__(self, args: list[str], store: Path | None, workdir: Path, db: Path | None = None) -> None:
        port = free_port()
        if db is None:
            db = workdir / f"store-{port}.db"
            if store is not None:
                shutil.copy(store, db)
        self.log = workdir / f"serve-{port}.log"
        self.url = f"http://127.0.0.1:{port}/v1"
        self.proc = launch([sys.executable, "-m", "specx", "serve", "--port", str(port), "--db", str(db), *args],
                           self.log, f"http://127.0.0.1:{port}/health", "specx serve")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


def summary(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    steps = [r["steps"] for r in rows if r["steps"] is not None]
    return {"requests": len(rows), "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2) if seconds else None,
            "mean_latency_s": round(seconds / len(rows), 3) if rows else None,
            "tokens_per_step": round(tokens / sum(steps), 3) if steps and sum(steps) else None,
            "draft_seconds": round(sum(r["draft_seconds"] or 0 for r in rows), 3),
            "verify_seconds": round(sum(r["verify_seconds"] or 0 for r in rows), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="weights dtype of the servers started here (auto: float32 "
                        "on CPU, bfloat16 on a GPU; lossless holds in float32)")
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--db", type=Path, help="start both servers from a copy of this store (default: empty)")
    parser.add_argument("--spec-url", help="use this running server (speculation on) instead of starting one")
    parser.add_argument("--plain-url", help="use this running server (--no-speculation) instead of starting one")
    parser.add_argument("--api-key", default=os.environ.get("SPECX_API_KEY", "none"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no spider_dev.json in {args.spider} (pass --spider FOLDER)")
    convs = conversations(args.spider, args.conversations, args.turns)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, url, flags in (("specx", args.spec_url, []), ("plain", args.plain_url, ["--no-speculation"])):
            server = None
            if url is None:
                print(f"starting specx serve {' '.join(flags)}...", file=sys.stderr)
                server = LocalServer(["--model", args.model, "--dtype", args.dtype, *flags], args.db, Path(tmp))
                url = server.url
            try:
                client = OpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=600)
                # One untimed request first: the model's first passes are slow.
                client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
                print(f"{name}: {sum(len(c['questions']) for c in convs)} requests...", file=sys.stderr)
                results[name] = run_workload(client, args.model, convs, args.max_tokens)
            finally:
                if server is not None:
                    server.stop()
    spec, plain = results["specx"], results["plain"]
    identical = sum(a["text"] == b["text"] for a, b in zip(spec, plain))
    overall = {"specx": summary(spec), "plain": summary(plain), "identical": identical, "requests": len(spec)}
    if overall["plain"]["tokens_per_s"]:
        overall["speedup"] = round(overall["specx"]["tokens_per_s"] / overall["plain"]["tokens_per_s"], 3)
    if args.json:
        print(json.dumps({"overall": overall, "requests": [
            {**{k: v for k, v in a.items() if k != "text"}, "plain_seconds": b["seconds"],
             "plain_tokens_per_s": b["tokens_per_s"], "identical": a["text"] == b["text"]}
            for a, b in zip(spec, plain)]}, indent=2))
        return
    print(f"{'conv':>4} {'turn':>4} {'prompt':>6} {'tokens':>6} {'specx s':>8} {'plain s':>8} {'specx tok/s':>11} "
          f"{'plain tok/s':>11} {'accepted/step':>13} {'same':>4}")
    for a, b in zip(spec, plain):
        per_step = a["accepted"] / a["steps"] if a["steps"] else float("nan")
        print(f"{a['conversation']:>4} {a['turn']:>4} {a['prompt_tokens']:>6} {a['tokens']:>6} {a['seconds']:>8.2f} "
              f"{b['seconds']:>8.2f} {a['tokens_per_s']:>11.1f} {b['tokens_per_s']:>11.1f} {per_step:>13.2f} "
              f"{'yes' if a['text'] == b['text'] else 'NO':>4}")
    s, p = overall["specx"], overall["plain"]
    print(f"\nspecx: {s['tokens']} tokens in {s['seconds']:.1f} s ({s['tokens_per_s']} tokens/s, mean latency "
          f"{s['mean_latency_s']} s, {s['tokens_per_step']} tokens/step)")
    print(f"plain: {p['tokens']} tokens in {p['seconds']:.1f} s ({p['tokens_per_s']} tokens/s, mean latency "
          f"{p['mean_latency_s']} s)")
    print(f"speedup {overall.get('speedup')}x; identical outputs: {identical}/{len(spec)}")


if __name__ == "__main__":
    main()
