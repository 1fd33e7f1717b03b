"""Issue 59, hole 4: a shaped stream's clock must not let drafts show in its gaps. The clock ran at
the learned cost of a one-token pass; a step that verifies a losing draft costs more, so a fresh
answer's events ran late while a history-drafted repeat ran on the clock (its median gap below the
fresh one's in 14 of 18 pairs). Now a slot bounds a whole step with the largest draft a shaped
server verifies, and the two answers' gaps come from one distribution.

The test is statistical, on a real server (built-in model, tenants, the default shaping): pairs
of a fresh answer and its drafted repeat; for each pair the sign of (repeat's median gap - fresh's);
a two-sided sign test at ALPHA. Under the null (the drafts do not show) it fails with probability
at most ALPHA (its false-alarm rate), whatever the machine's load, as load slows both alike."""

import json
import math
import statistics
import time

import httpx
import pytest

from helpers.servers import MODEL, Server, specx_home

KEYS = {"a": "gaps-key-a", "b": "gaps-key-b"}
PAIRS = 16
ALPHA = 0.01
PROMPTS = [f"Write one sentence about the number {n} and a {thing}." for n, thing in
           zip(range(3, 3 + PAIRS), ["river", "lamp", "fox", "train", "cloud", "bridge", "garden", "violin", "harbor",
                                     "desert", "castle", "comet", "forest", "island", "market", "tower"])]


def _gaps(srv: Server, prompt: str) -> tuple[str, list[float]]:
    """The streamed answer and the seconds between its content events."""
    times, text = [], ""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['a']}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                piece = "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    return text, [b - a for a, b in zip(times, times[1:])]


def sign_test(below: int, above: int) -> float:
    """Two-sided p-value of `below` of `below + above` under a fair coin (ties left out)."""
    n, k = below + above, min(below, above)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


@pytest.mark.slow
def test_a_drafted_answers_gaps_come_from_the_fresh_answers_distribution(tmp_path_factory):
    srv = Server(specx_home(tmp_path_factory), tmp_path_factory.mktemp("gaps") / "gaps.db",
                 "--tenant", f"a:{KEYS['a']}", "--tenant", f"b:{KEYS['b']}", "--backend", "quantized")
    try:
        _gaps(srv, "Name three colors.")  # the learned cost sees its first passes: the pace is learned after
        below = above = 0
        medians = []
        for prompt in PROMPTS:
            fresh_text, fresh = _gaps(srv, prompt)
            again_text, again = _gaps(srv, prompt)  # drafted from a's history: the same answer
            assert again_text == fresh_text
            f, a = statistics.median(fresh), statistics.median(again)
            medians.append((round(f * 1e3, 2), round(a * 1e3, 2)))
            below += a < f
            above += a > f
        p = sign_test(below, above)
        assert p >= ALPHA, f"repeats' median gap below the fresh ones' in {below} pairs, above in {above}: {medians}"
    finally:
        srv.stop()
