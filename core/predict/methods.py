"""The runs `specx replay` reports: every drafting method on the same stored calls.

Without a model (`run_replay`), each method replays the calls with the simulated verifier
(core.predict.replay): specx (global + request index, their best trees merged), specx keeping only
the better tree, each index alone, prompt lookup, and the reference implementation when importable.
With a model (`run_model_replay`), plain decoding, transformers' prompt lookup and specx decode the
same prompts (core.predict.compare). Prompts are rendered with the tokenizer's chat template and cut
to their last `prompt_window` tokens by the caller.

The reference is ArcticInference's C++ suffix tree (vLLM's `method="suffix"`). It is not a
dependency: it ships only as a source package that needs a C++ build (nanobind + CMake;
examples/build_reference.sh), so replay runs it when it is installed and says so when it is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..decode.hybrid import HybridDrafter, table_nodes
from ..decode.speculate import PromptLookupDrafter, SuffixDrafter
from ..draft import Draft
from ..index.successors import SuccessorTable
from ..index.suffix_index import SuffixIndex
from ..model.engine import Engine
from .compare import DRAFTER_METHODS, Comparison, Speculator, compare, summary
from .replay import ReplayResult, replay

METHODS = ("specx", "specx_unmerged", "global_only", "request_only", "prompt_lookup", "reference")


def make_drafter(method: str, params: dict[str, Any]) -> Any:
    common = dict(max_depth=params["max_depth"], max_spec_tokens=params["max_spec_tokens"],
                  max_spec_factor=params["max_spec_factor"], min_token_prob=params["min_token_prob"],
                  tree=params["tree"])
    if method == "specx":
        return SuffixDrafter(SuffixIndex(params["max_depth"]), merge_indexes=params["merge"], **common)
    if method == "specx_unmerged":  # DESIGN.md's rule: only the better of the two indexes' trees
        return SuffixDrafter(SuffixIndex(params["max_depth"]), merge_indexes=False, **common)
    if method == "global_only":
        return SuffixDrafter(SuffixIndex(params["max_depth"]), use_request=False, **common)
    if method == "request_only":
        return SuffixDrafter(SuffixIndex(params["max_depth"]), use_global=False, **common)
    if method == "prompt_lookup":
        return PromptLookupDrafter(params["max_spec_tokens"])
    if method == "reference":
        return ReferenceDrafter(**common)
    raise ValueError(f"unknown replay method {method!r}")


@dataclass
class MethodReplays:
    """`run_replay`'s result: each method's replay of the same calls, in the order run; the first is
    reported by group, the others are its baselines. `projection` (and the `cost_curves` it used)
    is what `specx replay --project` adds: {"overall": {curve: ...}, "groups": {key: {curve: ...}}}."""

    results: dict[str, ReplayResult]
    params: dict[str, Any]
    projection: dict[str, Any] | None = None
    cost_curves: list[dict[str, Any]] | None = None

    @property
    def method(self) -> str:
        return next(iter(self.results))

    @property
    def main(self) -> ReplayResult:
        return self.results[self.method]

    def to_json(self) -> dict[str, Any]:
        """The replay as `specx replay --json` prints it."""
        projected = self.projection or {}
        groups = [{"key": key, **stats.to_json()} for key, stats in sorted(self.main.groups.items())]
        for group in groups if projected else []:
            group["projected_speedup"] = projected["groups"][group["key"]]
        out = {"method": self.method, "overall": self.main.overall.to_json(), "groups": groups,
               "baselines": {m: r.overall.to_json() for m, r in self.results.items() if m != self.method},
               "baseline_groups": {m: [{"key": k, **s.to_json()} for k, s in sorted(r.groups.items())]
                                   for m, r in self.results.items() if m != self.method},
               "params": self.params}
        if projected:
            out |= {"projected_speedup": projected["overall"], "cost_curves": self.cost_curves}
        return out | {"accepted_hist": {m: dict(sorted(r.overall.accepted_hist.items()))
                                        for m, r in self.results.items()}}


def run_replay(calls: list[Any], prompts: list[np.ndarray], outputs: list[np.ndarray],
               warm: list[np.ndarray], params: dict[str, Any], by: str, methods: list[str],
               on_call: Callable[[], None] = lambda: None) -> MethodReplays:
    """Every method in `methods` replays the same calls (grouped by `by`), each after learning the
    `warm` outputs; the first method is the one reported, the others its baselines."""
    results: dict[str, ReplayResult] = {}
    _warm_up(params)
    for method in methods:
        drafter = make_drafter(method, params)
        for tokens in warm:  # sessions outside the selection, learned before the replay starts
            drafter.start_request(np.zeros(0, dtype=np.int32))
            drafter.extend(tokens)
            drafter.finish_request()
        stream = ((call.group(by), p, o) for call, p, o in zip(calls, prompts, outputs))
        results[method] = replay(stream, drafter, on_call=on_call)
    return MethodReplays(results, params)


def _warm_up(params: dict[str, Any]) -> None:
    """Load the compiled kernels before timing (numba loads each on first use, once per process)."""
    drafter = make_drafter("specx", params)
    for _ in range(2):
        drafter.start_request(np.array([1, 2, 3, 1, 2], dtype=np.int32))
        drafter.speculate()
        drafter.extend([3, 1])
        drafter.speculate()
        drafter.finish_request()


def plot(result: MethodReplays, path: Path, window: int = 50) -> None:
    """Tokens per step against calls replayed (rolling over `window` calls), and accepted lengths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, run in result.results.items():
        tokens = np.array([c[0] for c in run.curve], dtype=float)
        steps = np.array([c[1] for c in run.curve], dtype=float)
        if not len(tokens):
            continue
        kernel = np.ones(min(window, len(tokens)))
        rolling = np.convolve(tokens, kernel, "valid") / np.maximum(np.convolve(steps, kernel, "valid"), 1)
        left.plot(np.arange(len(rolling)) + len(kernel), rolling, label=method, linewidth=1.4)
    left.set_xlabel("calls replayed")
    left.set_ylabel(f"tokens per step (rolling {window} calls)")
    left.set_title("learning curve")
    left.legend()
    left.grid(alpha=0.3)
    hist = result.main.overall.accepted_hist
    lengths = sorted(hist)
    total = sum(hist.values()) or 1
    right.bar(lengths, [hist[k] / total for k in lengths], color="tab:blue")
    right.set_xlabel("accepted draft tokens per step")
    right.set_ylabel("share of steps")
    right.set_title(f"accepted length ({result.method})")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class ModelReplay:
    """`run_model_replay`'s result: the decoding methods compared on the stored calls' prompts.
    The command line fills in what it loaded (`model`, `backend`, `dtype`)."""

    comparison: Comparison
    params: dict[str, Any]
    calls: int
    prompt_tokens: int
    model: str | None = None
    backend: str | None = None
    dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        return self.comparison.to_json() | {"params": self.params, "calls": self.calls,
                                            "prompt_tokens": self.prompt_tokens, "model": self.model,
                                            "backend": self.backend, "dtype": self.dtype}


def run_model_replay(engine: Engine, tokenizer: Any, prompts: list[list[int]], warm: list[np.ndarray], *,
                     params: dict[str, Any], methods: list[str], max_tokens: int, cost: Any,
                     on_call: Callable[[], None] = lambda: None, prefix_cache_tokens: int = 0,
                     drafters: Sequence[str] = ("suffix",),
                     table: Callable[[], SuccessorTable] | None = None) -> ModelReplay:
    """Plain decoding, transformers' prompt lookup (where `methods` name them) and specx with each of
    `drafters` (suffix: "specx", table: "specx_table", hybrid: "specx_hybrid";
    core.predict.compare.DRAFTER_METHODS) on the same prompts, with the model (greedy, `engine`:
    core.model.engine.Engine); specx learns each output online, its successor tables (each made by
    `table`: a fresh one, or a copy of the store's) every pass."""
    speculators = {}
    for kind in drafters:
        suffix = make_drafter("specx", params) if kind != "table" else None
        for tokens in warm if suffix is not None else ():
            suffix.global_index.add(tokens)
        successors = (table or (lambda: SuccessorTable(engine.vocab_size)))() if kind != "suffix" else None
        drafter = suffix if successors is None else HybridDrafter(suffix, successors,
                                                                  max_nodes=table_nodes(engine.tree_unsupported))
        speculators[DRAFTER_METHODS[kind]] = Speculator(drafter, successors)
    _warm_up(params)
    compare(engine, [prompts[0][-16:]], None, max_new_tokens=4, eos_token_id=tokenizer.eos_token_id,
            methods=["plain"])  # first passes are slow
    methods = [m for m in methods if m != "specx"] + list(speculators)
    runs = compare(engine, prompts, None, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                   methods=methods, cost=cost, on_call=on_call, prefix_cache_tokens=prefix_cache_tokens,
                   speculators=speculators)
    return ModelReplay(summary(runs), params | {"max_tokens": max_tokens, "prefix_cache_tokens": prefix_cache_tokens},
                       len(prompts), sum(len(p) for p in prompts))


# ------------------------------------------------------------------ the reference, when importable

def reference_module() -> Any:
    from arctic_inference.suffix_decoding import _C  # type: ignore[import-not-found]

    return _C


def reference_available() -> bool:
    try:
        reference_module()
    except ImportError:
        return False
    return True


def why_reference_unavailable() -> str:
    try:
        reference_module()
    except ImportError as exc:
        return str(exc)
    return ""


class ReferenceDrafter:
    """The reference's SuffixDecodingCache (prompt tree + global tree of past responses) behind the
    replay drafter interface, with the same speculation parameters as specx."""

    def __init__(self, max_depth: int, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                 tree: bool) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found]

        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=-1)
        self.args = (max_spec_tokens, float(max_spec_factor), 0.0, float(min_token_prob), bool(tree))
        self.max_depth = max_depth
        self.request = 0
        self.tail: list[int] = []

    def start_request(self, prompt: Any) -> None:
        self.request += 1
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        self.cache.start_request(self.request, prompt)
        self.tail = prompt[-(self.max_depth + 1):].tolist()

    def extend(self, tokens: Any) -> None:
        self.cache.add_active_response(self.request, np.ascontiguousarray(tokens, dtype=np.int32))
        self.tail = (self.tail + list(tokens))[-(self.max_depth + 1):]

    def speculate(self) -> Draft:
        d = self.cache.speculate(self.request, np.asarray(self.tail, dtype=np.int32), *self.args)
        return Draft(list(d.token_ids), list(d.parents), list(d.probs), d.score, d.match_len)

    def finish_request(self, learn: bool = True) -> None:
        self.cache.stop_request(self.request)  # the response stays in its global tree
