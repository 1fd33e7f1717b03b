"""The reference implementation, when importable: ArcticInference's C++ suffix tree (vLLM's
`method="suffix"`), run on the same corpus and positions as specx for a side-by-side table.

It is not a dependency: it ships only as a source package that needs a C++ build (nanobind +
CMake), so the benchmark uses it when it is installed and says so when it is not. The README
tells how to build it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from specx.core.draft import Draft


def _module() -> Any:
    from arctic_inference.suffix_decoding import _C  # type: ignore[import-not-found]

    return _C


def available() -> bool:
    try:
        _module()
    except ImportError:
        return False
    return True


def why_unavailable() -> str:
    try:
        _module()
    except ImportError as exc:
        return str(exc)
    return ""


def bench(train: list[np.ndarray], test: list[np.ndarray], contexts: list[np.ndarray],
          continuations: list[list[int]], max_depth: int, max_spec_tokens: int) -> dict[str, Any]:
    """The same figures as specx's, where the reference has them (it cannot save or load),
    measured and summarised by the benchmark's own code, as specx's are."""
    from .figures import speculation_figures, time_speculation  # here: figures imports this module

    c = _module()
    num_tokens = int(sum(len(d) for d in train))
    t0 = time.perf_counter()
    tree = c.SuffixTree(max_depth)
    for i, doc in enumerate(train):
        tree.extend_ndarray(i, np.ascontiguousarray(doc, dtype=np.int32))
    build_s = time.perf_counter() - t0
    resident = tree.estimate_memory()

    def speculate(ctx: np.ndarray, tree_mode: bool) -> Draft:
        # It matches at most len(context) - 1 tokens, so it gets one more token of context.
        d = tree.speculate_ndarray(ctx, max_spec_tokens, 1.0, 0.0, 0.1, tree_mode)
        return Draft(d.token_ids, d.parents, d.probs, d.score, d.match_len)

    stats = {label: time_speculation(lambda ctx, t=tree_mode: speculate(ctx, t), contexts, continuations)
             for label, tree_mode in (("", True), ("path_", False))}
    live = c.SuffixTree(max_depth)
    appended = 0
    t0 = time.perf_counter()
    for i, doc in enumerate(test):
        for j in range(0, len(doc), 4):
            live.extend(i, doc[j : j + 4].tolist())
        appended += len(doc)
    append_s = time.perf_counter() - t0
    added = 0
    t0 = time.perf_counter()
    for i, doc in enumerate(test):
        tree.extend_ndarray(len(train) + i, np.ascontiguousarray(doc, dtype=np.int32))
        added += len(doc)
    add_s = time.perf_counter() - t0
    return {
        "tokens": num_tokens,
        "build_tokens_per_s": num_tokens / build_s,
        "bytes_per_token": resident / max(num_tokens, 1),
        "load_tokens_per_s": None,  # no persistence: rebuilt from tokens at every start
        "append_us_per_token": 1e6 * append_s / max(appended, 1),
        "add_us_per_token": 1e6 * add_s / max(added, 1),
        **speculation_figures(stats[""], stats["path_"]),
    }


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
