"""Timing a model's verification passes over 1..n tokens: a measured ForwardCost (`specx bench cost`).

Decoding never calls this (the cost is learned from the passes it runs: core.cost.learned); it
measures a curve to compare against, or to ship as a prior (core/cost/curves/).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..core.cost.forward import ForwardCost
from ..core.draft import Draft
from ..core.model.transformers.prefix_cache import TransformersPrefixCache
from ..core.model.transformers.tree import tree_logits, tree_unsupported

# On a CPU, core.model.transformers.kernels pads 4 to 64 rows to a multiple of 4 (and MKL takes the rest): the cost is
# a step function there, so both ends of each step are measured up to 25, where most drafts end
# (interpolation between 5 and 8 is then flat, as the kernel is); beyond, a straight line between
# the sizes measured; a GPU's flat curve needs none of it.
SIZES = (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 32, 48, 64)


def calibrate(model: Any, sizes: Sequence[int] = SIZES, *, repeats: int = 3, context: int = 128,
              max_size: int | None = None, long_context: int | None = 1024) -> ForwardCost:
    """Time one verification pass over n tokens (a linear draft of n - 1 after one pending token)
    on a cache of `context` tokens, and of `long_context` tokens (None: skip); the median of
    `repeats` runs per size, after a warm-up. `max_size` drops larger sizes (a step never verifies
    more than 1 + max draft tokens)."""
    if max_size is not None:
        sizes = [n for n in sizes if n <= max_size] or [1]
    if not isinstance(model, torch.nn.Module):  # an Engine (core.model.engine): any engine, through its sessions
        short = _time_engine_passes(model, sizes, repeats, context)
        long = _time_engine_passes(model, sizes, repeats, long_context) if long_context else None
        return ForwardCost(tuple(int(s) for s in sizes), short, context, long, long_context or 0)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if long_context is not None and limit and long_context + max(sizes) > limit:
        long_context = None  # a model with a short context: one curve
    short = _time_passes(model, sizes, repeats, context)
    long = _time_passes(model, sizes, repeats, long_context) if long_context else None
    return ForwardCost(tuple(int(s) for s in sizes), short, context, long, long_context or 0)


def _time_passes(model: Any, sizes: Sequence[int], repeats: int, context: int) -> tuple[float, ...]:
    rng = np.random.default_rng(0)
    vocab = int(model.config.vocab_size)
    cache = TransformersPrefixCache(0).prefill(model, rng.integers(0, vocab, size=context).tolist())
    linear = tree_unsupported(model)
    seconds = []
    # a GPU runs the pass asynchronously: wait for it (a step waits too, when it reads the logits)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for n in sizes:
            draft_tokens = rng.integers(0, vocab, size=n - 1).tolist()
            draft = Draft(draft_tokens, list(range(-1, n - 2)), [1.0] * (n - 1), float(n - 1), 1)
            runs = []
            for r in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                tree_logits(model, cache, [int(rng.integers(vocab))], draft, linear=linear)
                sync()
                if r:  # the first run warms up
                    runs.append(time.perf_counter() - t0)
                cache.crop(-n)
            seconds.append(float(np.median(runs)))
    return tuple(seconds)


def _time_engine_passes(engine: Any, sizes: Sequence[int], repeats: int, context: int) -> tuple[float, ...]:
    """_time_passes through the Engine protocol: each pass keeps its pending token (the cache grows
    by one a pass, a few dozen tokens over the whole curve)."""
    rng = np.random.default_rng(0)
    vocab = int(engine.vocab_size)
    engine.clear()
    session = engine.start(rng.integers(0, vocab, size=context).tolist())
    seconds = []
    for n in sizes:
        draft = Draft(rng.integers(0, vocab, size=n - 1).tolist(), list(range(-1, n - 2)), [1.0] * (n - 1),
                      float(n - 1), 1)
        runs = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            session.score([int(rng.integers(vocab))], draft)
            if r:  # the first run warms up
                runs.append(time.perf_counter() - t0)
            session.keep_path([])
        seconds.append(float(np.median(runs)))
    return tuple(seconds)


def pass_bytes(engine: Any) -> tuple[int, int]:
    """(bytes of weights one pass reads, multiply-adds per token) of an Engine: specx's engines count
    their own (the quantized engine's packed weights, the GPU engine's bfloat16 ones), transformers'
    linear layers (their packed float copy), llama.cpp's file."""
    if getattr(engine, "name", "") == "llama.cpp":
        import gguf

        reader = gguf.GGUFReader(engine.path)
        weights = [t for t in reader.tensors if len(t.shape) == 2]
        tied = not any(t.name == "output.weight" for t in weights)
        read = [t for t in weights if t.name != "token_embd.weight" or tied]
        return sum(int(t.n_bytes) for t in read), sum(int(t.n_elements) for t in read)
    if not isinstance(engine.model, torch.nn.Module):  # specx's own engines' models count their weights
        return engine.model.weight_bytes, engine.model.multiply_adds
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    return (sum(m.weight.numel() * m.weight.element_size() for m in linears),
            sum(m.weight.numel() for m in linears))


def machine_limits(seconds: float = 0.5) -> dict[str, float]:
    """This machine's memory bandwidth (GB/s: summing a 512 MB array on every thread torch uses)
    and arithmetic peak (GFLOP/s: a 1024 x 1024 float32 matrix product), each the best of a few runs
    within about `seconds`."""
    data = torch.ones(128 << 20, dtype=torch.float32)  # 512 MB: far past any cache
    a = torch.randn(1024, 1024)
    best_read, best_mm = float("inf"), float("inf")
    data.sum()
    a @ a
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        data.sum()
        best_read = min(best_read, time.perf_counter() - t0)
        t0 = time.perf_counter()
        a @ a
        best_mm = min(best_mm, time.perf_counter() - t0)
    return {"memory_gb_s": round(data.numel() * 4 / best_read / 1e9, 1),
            "float32_gflop_s": round(2 * 1024**3 / best_mm / 1e9, 1)}
