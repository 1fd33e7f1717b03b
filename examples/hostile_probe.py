"""Replay issue 39's hostile requests against a running `specx serve`, so the next probe starts from them.

Each case is sent as a careless or hostile client would (raw HTTP where a client library would
refuse: lone surrogates, a short body), then a small request checks that the server still answers.
A table (or --json): the case, the HTTP status, the error's param, whether the server then answered.

    specx serve --port 8000 &
    .venv/bin/python examples/hostile_probe.py --url http://127.0.0.1:8000 [--api-key KEY] [--big-mb 30]

Expected (docs/reliability.md, rows 13-18 and 27): every case a 4xx naming the field, never a 500, and
the server answering after each; `--big-mb` sends three prompts of that many MB at once (row 15).
`--detokenize N` also sends N ids to /detokenize (issue 47 sent 15,000,000: a 400 naming `tokens`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from urllib.parse import urlparse

SURROGATE = "\ud800"


def cases(model: str) -> list[tuple[str, str, dict | None]]:
    """(name, path, body): bodies are JSON with lone surrogates escaped (\\ud800), as a hostile client sends them."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    return [
        ("stop holding a lone surrogate", "/v1/chat/completions", chat | {"stop": ["x", SURROGATE]}),
        ("model holding a lone surrogate", "/v1/chat/completions", chat | {"model": SURROGATE}),
        ("prediction holding a lone surrogate", "/v1/chat/completions",
         chat | {"prediction": {"type": "content", "content": "a" + SURROGATE}}),
        ("message holding a lone surrogate", "/v1/chat/completions",
         chat | {"messages": [{"role": "user", "content": "hi " + SURROGATE}]}),
        ("completions prompt holding a lone surrogate", "/v1/completions",
         {"model": model, "prompt": "SELECT" + SURROGATE, "max_tokens": 4}),
        ("/tokenize prompt holding a lone surrogate", "/tokenize", {"model": model, "prompt": SURROGATE}),
        ("temperature 1e-320 (a subnormal)", "/v1/chat/completions", chat | {"temperature": 1e-320}),
        ("temperature -1", "/v1/chat/completions", chat | {"temperature": -1}),
        ("max_tokens 0", "/v1/chat/completions", chat | {"max_tokens": 0}),
        ("logprobs 21", "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 21}),
        ("/detokenize of more ids than any context (issue 47)", "/detokenize", {"model": model, "tokens": [1] * 300_000}),
    ]


def send(url: str, path: str, body: bytes | None, key: str | None, length: int | None = None,
         timeout: float = 120.0) -> tuple[int, dict]:
    """One raw HTTP request; (status, JSON body or {}); status 0 when the connection failed."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        if body is None:
            conn.request("GET", path, headers=headers)
        else:
            headers["Content-Length"] = str(len(body) if length is None else length)
            conn.putrequest("POST", path)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            conn.send(body)
            if length is not None and length > len(body):
                conn.sock.shutdown(1)  # the rest of the body never comes
        response = conn.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data or b"{}")
        except ValueError:
            return response.status, {}
    except OSError:
        return 0, {}
    finally:
        conn.close()


def encode(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=True).encode()  # "\ud800" stays an escape: the JSON is valid


def alive(url: str, key: str | None, model: str) -> bool:
    status, data = send(url, "/v1/chat/completions", encode(
        {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}),
        key, timeout=60)
    return status == 200 and bool(data.get("choices"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key")
    parser.add_argument("--model", default="smollm2-135m", help="the served model name")
    parser.add_argument("--big-mb", type=float, default=0.0, help="also send three prompts of this many MB at once")
    parser.add_argument("--detokenize", type=int, default=0, help="also send this many ids to /detokenize")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if send(args.url, "/health", None, args.api_key)[0] != 200:
        sys.exit(f"error: {args.url}/health is not 200: start `specx serve` first")
    rows = []
    for name, path, body in cases(args.model):
        status, data = send(args.url, path, encode(body), args.api_key)
        error = data.get("error") or {}
        rows.append({"case": name, "status": status, "param": error.get("param"),
                     "answers_after": alive(args.url, args.api_key, args.model)})
    if args.detokenize:
        status, data = send(args.url, "/detokenize", encode({"tokens": [1234] * args.detokenize}), args.api_key)
        rows.append({"case": f"/detokenize of {args.detokenize:,} ids", "status": status,
                     "param": (data.get("error") or {}).get("param"), "answers_after": alive(args.url, args.api_key,
                                                                                           args.model)})
    status, data = send(args.url, "/v1/chat/completions", b'{"mo', args.api_key, length=4096, timeout=10)
    rows.append({"case": "Content-Length larger than the body", "status": status, "param": None,
                 "answers_after": alive(args.url, args.api_key, args.model)})
    if args.big_mb > 0:
        big = encode({"model": args.model, "prompt": "x " * int(args.big_mb * 2**19), "max_tokens": 2})
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(send(args.url, "/v1/completions", big,
                                                                       args.api_key)[0])) for _ in range(3)]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        small = alive(args.url, args.api_key, args.model)
        waited = time.perf_counter() - t0
        for t in threads:
            t.join()
        rows.append({"case": f"three {args.big_mb:g} MB prompts at once (a small request beside them: "
                             f"{waited:.1f} s)", "status": max(results) if results else 0, "param": None,
                     "answers_after": small})
    health = send(args.url, "/health", None, args.api_key)[0]
    if args.json:
        print(json.dumps({"cases": rows, "health_after": health}, indent=2))
        return
    for r in rows:
        print(f"{r['case']:<62} {r['status']:>4}  {str(r['param'] or '-'):<34} "
              f"{'answers' if r['answers_after'] else 'NO ANSWER'}")
    # a client that sent a short body and left gets no answer (nobody is there to read it); the rest must get one
    bad = [r for r in rows if r["status"] >= 500 or not r["answers_after"]
           or (r["status"] == 0 and not r["case"].startswith("Content-Length"))]
    print(f"/health after: {health}; {len(bad)} case(s) with a 5xx, no answer or a server that stopped answering")
    sys.exit(1 if bad or health != 200 else 0)


if __name__ == "__main__":
    main()
