"""The live store: how soon what `specx ingest` writes into a serving store drafts, and what it costs
the requests in flight.

A `specx serve` (quantized engine, one tenant) answers a client that streams long answers one
after another; after a quiet spell, `specx ingest LOGS` writes into the same store. Reported: the
seconds from the ingest's end until the server's index holds every ingested output (/metrics: a
request's next step drafts from them), and the gaps between the streamed events of the requests in
flight (the largest gap, and the 99th percentile): quiet; while the same logs are ingested into
another store, which the server does not follow (the control: the ingest's own CPU, on the same
cores); while they are ingested into the server's store; and while the server indexes them.

    .venv/bin/python examples/live_store_bench.py --json docs/results/live_store.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from side_channel import MODEL, Server  # noqa: E402 - the same server harness

LOGS = Path(__file__).resolve().parents[1].parent / "shared" / "agent-data" / "swe-agent-multi-swe-bench-java"


def index_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specx_global_index_tokens "))


def stored_tokens(db: Path, served: bool) -> int:
    """Tokens of the store's served outputs (the server learned them as it answered), or of the rest."""
    from specx.store.db import Store

    with Store(db, readonly=True) as store:
        return int(store.db.execute(
            "SELECT coalesce(sum(t.num_tokens), 0) FROM tokens t JOIN calls c ON c.id = t.call_id JOIN sessions s"
            f" ON s.id = c.session_id WHERE s.format {'=' if served else '!='} 'served'").fetchone()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="?", type=Path, default=LOGS, help="what to ingest while serving")
    parser.add_argument("--quiet", type=float, default=8.0, help="seconds of streaming before the ingest")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        server = Server(folder, [])
        db = folder / "store.db"
        arrivals: list[float] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                with httpx.stream("POST", server.url + "/v1/completions", timeout=300, json={
                        "model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "temperature": 0,
                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            arrivals.append(time.perf_counter())

        thread = threading.Thread(target=client, daemon=True)
        try:
            thread.start()
            time.sleep(args.quiet)
            # the control: the same ingest into another store, which the server does not follow (the
            # gaps it makes are the ingest's CPU alone)
            c_start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "specx", "ingest", str(args.logs), "--db", str(folder / "other.db")],
                           capture_output=True, text=True)
            c_end = time.perf_counter()
            time.sleep(2.0)
            before = index_tokens(server.url)
            t_start = time.perf_counter()
            ingest = subprocess.run([sys.executable, "-m", "specx", "ingest", str(args.logs), "--db", str(db)],
                                    capture_output=True, text=True)
            t_end = time.perf_counter()
            ingested = stored_tokens(db, served=False)
            visible = None
            while time.perf_counter() - t_end < 120:  # the index holds what was served, and all that was ingested
                if index_tokens(server.url) - stored_tokens(db, served=True) >= ingested:
                    visible = time.perf_counter()
                    break
                time.sleep(0.02)
            time.sleep(2.0)
            stop.set()
            thread.join(60)
        finally:
            server.stop()
        log = server.log.read_text()

    def gaps(lo: float, hi: float) -> list[float]:
        ts = [t for t in arrivals if lo <= t <= hi]
        return sorted(b - a for a, b in zip(ts, ts[1:]) if b - a < 5.0)

    def summary(g: list[float]) -> dict[str, float]:
        return {"events": len(g), "max_ms": round(1000 * g[-1], 1) if g else 0.0,
                "p99_ms": round(1000 * g[int(0.99 * (len(g) - 1))], 1) if g else 0.0,
                "median_ms": round(1000 * g[len(g) // 2], 1) if g else 0.0}

    first = arrivals[0] if arrivals else t_start
    result = {"machine": platform.processor() or platform.machine(), "logs": str(args.logs),
              "ingest_exit": ingest.returncode, "ingest_seconds": round(t_end - t_start, 2),
              "index_tokens_before": before, "ingested_tokens": ingested,
              "visible_after_ingest_s": round(visible - t_end, 3) if visible else None,
              "gaps_quiet": summary(gaps(first + 1.0, c_start)),
              "gaps_ingest_elsewhere": summary(gaps(c_start, c_end)),
              "gaps_during_ingest": summary(gaps(t_start, t_end)),
              "gaps_while_indexing": summary(gaps(t_end, (visible or t_end) + 1.0)),
              "watch_lines": [line for line in log.splitlines() if "store watch" in line][-5:]}
    print(f"ingest {result['ingest_seconds']} s ({ingested:,} tokens); drafting from it "
          f"{result['visible_after_ingest_s']} s after the ingest ended")
    for name in ("gaps_quiet", "gaps_ingest_elsewhere", "gaps_during_ingest", "gaps_while_indexing"):
        g = result[name]
        print(f"{name:<22} events {g['events']:>5}  median {g['median_ms']:>7} ms  p99 {g['p99_ms']:>7} ms  "
              f"max {g['max_ms']:>7} ms")
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
