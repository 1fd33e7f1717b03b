"""Does one tenant's big corpus POST stall another tenant's stream? (issue 59, hole 2)

A real `specx serve` with two tenants (built-in model, quantized engine, shaped streams): tenant b
streams a long completion, alone and then while tenant a POSTs a corpus of `--megabytes` of text
to /v1/corpus; b's longest gap between stream events, each way, per trial. Past 8M characters a
corpus is refused before it is tokenized; under that it is tokenized (on a tokenizer of its own)
and stored.

    python examples/corpus_stall.py --megabytes 14 --trials 3
    python examples/corpus_stall.py --megabytes 7.3 --trials 2
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from side_channel import KEYS, MODEL, MODES, Server, cpu_name

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "river", "stone", "light", "night", "table"]


def longest_gap(url: str, tokens: int) -> float:
    """b's streamed completion: the longest gap between its events, in seconds."""
    body = {"model": MODEL, "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": tokens,
            "temperature": 0, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['b']}"},
                      timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return max(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=14.0, help="size of a's corpus texts")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=400, help="tokens of b's streamed answer")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    rng = random.Random(1)
    text = " ".join(rng.choice(WORDS) for _ in range(20000))  # ~118 KB
    texts = [text] * max(1, round(args.megabytes * 1e6 / len(text)))
    trials = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), MODES["shaped"])
        try:
            for _ in range(3):
                longest_gap(server.url, args.tokens)  # the shaped pace is learned
            for trial in range(args.trials):
                alone, post = longest_gap(server.url, args.tokens), {}

                def send(name: str = f"big{trial}") -> None:
                    t0 = time.perf_counter()
                    r = httpx.post(server.url + "/v1/corpus", json={"name": name, "texts": texts},
                                   headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=600)
                    post.update(status=r.status_code, seconds=round(time.perf_counter() - t0, 2),
                                answer=r.json().get("tokens") or r.json().get("error", {}).get("message"))
                sender = threading.Thread(target=send)
                sender.start()
                time.sleep(0.3)
                beside = longest_gap(server.url, args.tokens)
                sender.join()
                trials.append({"alone_longest_gap_s": round(alone, 3), "beside_post_longest_gap_s": round(beside, 3),
                               "post": post})
                print(trials[-1], flush=True)
        finally:
            server.stop()
    result = {"machine": cpu_name(), "model": MODEL, "corpus_chars": len(text) * len(texts), "trials": trials}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
