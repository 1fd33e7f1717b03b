"""What stream shaping costs a client: answer time shaped against plain decoding, as a server ages.

Two fresh servers on loopback (built-in model, quantized engine): plain decoding (`--no-speculation`,
not shaped: one event per step, as soon as it is ready) and a shaped one (two tenants: shaping on,
speculation on). Each answers the same fresh prompts in rounds; before a round, `--warm` more
requests teach the shaped server's learned cost (its slot is a bound on a plain step, read at a high
quantile over its recent steps: cli/live.py, core/serve/pace.py). Per round: the median answer time
(first byte sent to last event) and median gap between events of each server, their ratio, and on
the shaped server the gaps of history-drafted repeats beside the fresh answers' (shaping should make
them alike).

    python examples/shaping_cost.py --rounds 3 --answers 16 --warm 0,20,40 --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from side_channel import KEYS, MODEL, MODES, Server, cpu_name, stream

WORDS = ["river", "lamp", "fox", "train", "cloud", "bridge", "garden", "violin", "harbor", "desert", "castle",
         "comet", "forest", "island", "market", "tower", "candle", "mirror", "anchor", "meadow"]


def prompt(i: int) -> str:
    return f"Note {i}: a short story about a {WORDS[i % len(WORDS)]} and the number {i * 7 % 101} begins"


def answers(url: str, key: str | None, prompts: list[str], tokens: int) -> tuple[list[float], list[float]]:
    """(answer seconds, gaps between content events) over `prompts`."""
    seconds, gaps = [], []
    for p in prompts:
        trace = stream(url, key, {"model": MODEL, "prompt": p, "max_tokens": tokens, "temperature": 0})
        times = [e["t"] for e in trace["events"]]
        seconds.append(times[-1] if times else trace["seconds"])
        gaps += [b - a for a, b in zip(times, times[1:])]
    return seconds, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=int, default=16, help="fresh answers per server and round")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per answer")
    parser.add_argument("--warm", default="3,20,40", help="requests each server answers before each round (comma-separated)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    warm = [int(w) for w in args.warm.split(",")]
    rounds, next_prompt = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        for name, extra in (("plain", ["--no-speculation"]), ("shaped", MODES["shaped"])):
            (Path(tmp) / name).mkdir()
            servers[name] = (Server(Path(tmp) / name, extra), None if name == "plain" else KEYS["b"])
        try:
            for w in warm:
                fresh = [prompt(i) for i in range(next_prompt + w, next_prompt + w + args.answers)]
                row = {"warm": w}
                for name, (server, key) in servers.items():
                    answers(server.url, key, [prompt(i) for i in range(next_prompt, next_prompt + w)], args.tokens)
                    s, g = answers(server.url, key, fresh, args.tokens)
                    row[name] = {"answer_s": statistics.median(s), "gap_ms": 1000 * statistics.median(g),
                                 "gap_p90_ms": 1000 * sorted(g)[int(0.9 * len(g))]}
                server, key = servers["shaped"]
                s, g = answers(server.url, key, fresh, args.tokens)  # repeats: drafted from b's own history
                row["shaped_repeat"] = {"answer_s": statistics.median(s), "gap_ms": 1000 * statistics.median(g),
                                        "gap_p90_ms": 1000 * sorted(g)[int(0.9 * len(g))]}
                row["shaped_vs_plain"] = row["shaped"]["answer_s"] / row["plain"]["answer_s"]
                rounds.append(row)
                next_prompt += w + args.answers
                print(f"after {sum(r['warm'] for r in rounds) + args.answers * (len(rounds) - 1)} requests: "
                      f"shaped {row['shaped']['answer_s']:.3f} s, plain {row['plain']['answer_s']:.3f} s "
                      f"({row['shaped_vs_plain']:.2f}x)", file=sys.stderr, flush=True)
        finally:
            for server, _ in servers.values():
                server.stop()
    print(f"{'requests before':>15} {'plain s':>8} {'shaped s':>9} {'shaped/plain':>12} {'gap ms plain':>12} "
          f"{'shaped fresh':>12} {'repeat':>7} {'p90 plain':>9} {'fresh':>6} {'repeat':>7}")
    seen = 0
    for r in rounds:
        seen += r["warm"]
        print(f"{seen:>15} {r['plain']['answer_s']:>8.3f} {r['shaped']['answer_s']:>9.3f} {r['shaped_vs_plain']:>11.2f}x "
              f"{r['plain']['gap_ms']:>12.2f} {r['shaped']['gap_ms']:>12.2f} {r['shaped_repeat']['gap_ms']:>7.2f} "
              f"{r['plain']['gap_p90_ms']:>9.2f} {r['shaped']['gap_p90_ms']:>6.2f} {r['shaped_repeat']['gap_p90_ms']:>7.2f}")
        seen += args.answers
    result = {"machine": cpu_name(), "model": MODEL, "tokens": args.tokens, "answers": args.answers, "rounds": rounds}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
