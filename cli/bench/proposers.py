"""vLLM's proposers timed inside its engine (SPECX_PROPOSER_STATS, set by examples/vllm_bench.py)."""

from __future__ import annotations

import json
import os
import multiprocessing.util
import time
from pathlib import Path
from typing import Any

from ..vllm import after_import


def register() -> None:
    """The bench's `vllm.general_plugins` entry point: inert unless SPECX_PROPOSER_STATS (a file
    path, set by examples/vllm_bench.py) is set."""
    if os.environ.get("SPECX_PROPOSER_STATS"):
        time_proposers(Path(os.environ["SPECX_PROPOSER_STATS"]))


def time_proposers(path: Path) -> None:
    """Measure vLLM's n-gram and suffix proposers (specx's included): for each `propose` call, its
    wall-clock start, seconds, and the request-steps it saw (rows with sampled tokens), written as
    JSON to `path` at exit of the process that drafted (examples/vllm_bench.py reads it). The
    proposers are wrapped when vLLM imports them: importing them here, at plugin load, would come
    before vLLM's CPU kernel set-up and break it."""
    calls: list[tuple[float, float, int]] = []

    def timed(orig: Any, sampled_at: int) -> Any:
        def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
            start, t0 = time.time(), time.perf_counter()
            out = orig(self, *args, **kwargs)
            sampled = kwargs.get("sampled_token_ids", args[sampled_at] if len(args) > sampled_at else [])
            calls.append((start, time.perf_counter() - t0, sum(1 for s in sampled if len(s))))
            return out
        return propose

    def write() -> None:
        if calls:
            path.write_text(json.dumps(calls))

    def wrap(cls_name: str, sampled_at: int) -> Any:
        def hook(module: Any) -> None:
            cls = getattr(module, cls_name)
            cls.propose = timed(cls.propose, sampled_at)
        return hook

    after_import({"vllm.v1.spec_decode.suffix_decoding": wrap("SuffixDecodingProposer", 2),
                  "vllm.v1.spec_decode.ngram_proposer": wrap("NgramProposer", 1)})
    multiprocessing.util.Finalize(None, write, exitpriority=50)
