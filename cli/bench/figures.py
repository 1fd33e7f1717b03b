"""`specx bench index`: build, size, load, append and speculate figures of the suffix index.

Each corpus is split into indexed documents and held-out documents; speculation is timed at
held-out positions with the preceding max_depth tokens as context, and scored by the longest
draft path equal to the true continuation. When the reference implementation (ArcticInference's
C++ suffix tree) is importable, the same corpus and positions run through it in the same run.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..core.draft import Draft
from ..core.index.suffix_index import SuffixIndex
from ..core.predict.methods import reference_available, reference_module

from .synthetic import synthetic_corpus


TARGETS = {  # issue: foundation and suffix index
    "bytes_per_token": ("<=", 16),
    "build_tokens_per_s": (">=", 1_000_000),
    "load_tokens_per_s": (">=", 50_000_000),
    "speculate_p50_us": ("<=", 50),
    "speculate_p99_us": ("<=", 1000),
    "append_us_per_token": ("<=", 10),
}


def split_corpus(docs: list[np.ndarray], num_positions: int, seed: int) -> tuple[list, list, list]:
    """(indexed docs, held-out docs, [(held-out doc index, position)]) with >= num_positions positions."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    held, held_tokens = [], 0
    # Hold out about 5% of the tokens, and enough for the positions.
    want = max(sum(len(d) for d in docs) // 20, 2 * num_positions)
    while order.size and held_tokens < want and len(held) < len(docs) - 1:
        held.append(int(order[len(held)]))
        held_tokens += len(docs[held[-1]])
    held_set = set(held)
    train = [d for i, d in enumerate(docs) if i not in held_set]
    test = [docs[i] for i in held]
    candidates = [(k, pos) for k, d in enumerate(test) for pos in range(1, len(d))]
    if not candidates:
        return train, test, []
    pick = rng.choice(len(candidates), size=min(num_positions, len(candidates)), replace=False)
    return train, test, [candidates[i] for i in sorted(pick)]


def bench_corpus(name: str, docs: list[np.ndarray], *, num_positions: int = 2000, max_depth: int = 64,
                 max_spec_tokens: int = 32, seed: int = 0, with_reference: bool = True,
                 on_step: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """All figures for one corpus: {"specx": {...}, "reference": {...} or None, ...}."""
    train, test, positions = split_corpus(docs, num_positions, seed)
    contexts = [np.ascontiguousarray(test[k][max(0, pos - max_depth) : pos]) for k, pos in positions]
    continuations = [test[k][pos : pos + max_depth].tolist() for k, pos in positions]
    on_step(f"{name}: specx build")
    result = {"corpus": name, "documents": len(train), "held_out_documents": len(test),
              "positions": len(positions), "specx": _bench_specx(train, test, contexts, continuations,
                                                                max_depth=max_depth, max_spec_tokens=max_spec_tokens)}
    result["reference"] = None
    if with_reference and reference_available():
        on_step(f"{name}: reference build")
        # The reference matches at most len(context) - 1 tokens: give it one more token of context.
        ref_contexts = [np.ascontiguousarray(test[k][max(0, pos - max_depth - 1) : pos]) for k, pos in positions]
        result["reference"] = reference_figures(train, test, ref_contexts, continuations, max_depth=max_depth,
                                                max_spec_tokens=max_spec_tokens)
    return result


def _warm_up(max_depth: int) -> None:
    """Load every compiled kernel once, outside the timings (numba loads each on first use)."""
    index = SuffixIndex.build([[1, 2, 3, 1, 2]], max_depth=max_depth)
    seq_id = index.start([1, 2])
    index.append(seq_id, [3, 1])
    index.speculate([1, 2])
    index.finish(seq_id)
    index.add([2, 3])
    SuffixIndex.from_bytes(index.to_bytes()).count([1])


def _bench_specx(train, test, contexts, continuations, *, max_depth, max_spec_tokens) -> dict[str, Any]:
    num_tokens = int(sum(len(d) for d in train))
    _warm_up(max_depth)
    build_s = _median_of(3, lambda: SuffixIndex.build(train, max_depth=max_depth))
    index = SuffixIndex.build(train, max_depth=max_depth)
    resident_bytes = index.nbytes  # arrays at exact size after a bulk build
    blob = index.to_bytes()

    def load() -> None:
        loaded = SuffixIndex.from_bytes(blob)
        loaded.count(train[0][:1] if len(train) and len(train[0]) else [])  # usable, not just parsed

    load_s = _median_of(5, load)
    latencies, accepted = time_speculation(
        lambda ctx: index.speculate(ctx, max_spec_tokens=max_spec_tokens), contexts, continuations)
    path_lat, path_acc = time_speculation(
        lambda ctx: index.speculate(ctx, max_spec_tokens=max_spec_tokens, tree=False), contexts, continuations)
    # Live appends (the request index): a verification step adds a few tokens at a time.
    live = SuffixIndex(max_depth=max_depth)
    appended = 0
    t0 = time.perf_counter()
    for doc in test:
        seq_id = live.start(doc[:0])
        for i in range(0, len(doc), 4):
            live.append(seq_id, doc[i : i + 4])
        appended += len(doc)
    append_s = time.perf_counter() - t0
    # Finished sequences into the big index (segments appended and merged).
    added = 0
    t0 = time.perf_counter()
    for doc in test:
        index.add(doc)
        added += len(doc)
    add_s = time.perf_counter() - t0
    return {
        "tokens": num_tokens,
        "build_tokens_per_s": num_tokens / build_s,
        "bytes_per_token": resident_bytes / max(num_tokens, 1),
        "serialised_bytes_per_token": len(blob) / max(num_tokens, 1),
        "load_tokens_per_s": num_tokens / load_s,
        "append_us_per_token": 1e6 * append_s / max(appended, 1),
        "add_us_per_token": 1e6 * add_s / max(added, 1),
        **speculation_figures((latencies, accepted), (path_lat, path_acc)),
    }


def speculation_figures(tree: tuple[np.ndarray, np.ndarray], path: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """The reported latency and acceptance figures from (latencies, accepted) of tree and path drafts."""
    return {
        "speculate_p50_us": float(np.percentile(tree[0], 50)),
        "speculate_p99_us": float(np.percentile(tree[0], 99)),
        "mean_accepted": float(np.mean(tree[1])),
        "path_speculate_p50_us": float(np.percentile(path[0], 50)),
        "path_mean_accepted": float(np.mean(path[1])),
    }


def time_speculation(speculate: Callable, contexts: list, continuations: list) -> tuple[np.ndarray, np.ndarray]:
    if contexts:
        speculate(contexts[0])  # compile / warm caches
    latencies = np.empty(len(contexts))
    accepted = np.empty(len(contexts))
    for i, (ctx, cont) in enumerate(zip(contexts, continuations)):
        t0 = time.perf_counter_ns()
        draft = speculate(ctx)
        latencies[i] = (time.perf_counter_ns() - t0) / 1000
        accepted[i] = draft.accepted_len(cont) if draft is not None else 0
    return latencies, accepted


def _median_of(n: int, fn: Callable[[], Any]) -> float:
    seconds = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return float(np.median(seconds))


def synthetic_docs(num_tokens: int, seed: int) -> list[np.ndarray]:
    return synthetic_corpus(num_tokens=num_tokens, vocab_size=32_000, seed=seed)


def agent_log_docs(root: Path, tokenizer: Any) -> tuple[list[np.ndarray], dict[str, int]]:
    """Outputs of every call in the logs under `root`, tokenized; and calls per format."""
    from ..store.formats import Call, find_logs, read_calls

    texts: list[str] = []
    by_format: dict[str, int] = {}
    for path, fmt in find_logs([root]):
        if fmt is None:
            continue
        for item in read_calls(path, fmt):
            if isinstance(item, Call) and item.output_text:
                texts.append(item.output_text)
                by_format[fmt] = by_format.get(fmt, 0) + 1
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: batch encoding on all cores
    encoded = backend.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encoded], by_format


def machine() -> dict[str, Any]:
    import os

    import numba

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "numba": numba.__version__, "platform": platform.platform()}


def check_targets(figures: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for key, (op, bound) in TARGETS.items():
        value = figures.get(key)
        if value is not None:
            out[key] = value <= bound if op == "<=" else value >= bound
    return out


def bench_ingest(root: Path, workdir: Path, tokenizer: Any, on_step: Callable[[str], None] = lambda s: None) -> dict:
    """Ingest `root` into a new store, then again; sizes and the index load time."""
    from ..store.db import Store
    from ..store.index import load_index
    from ..store.ingest import ingest

    db = workdir / "bench-ingest.db"
    for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm")):
        p.unlink(missing_ok=True)
    tokenizer.get()  # load (and cache) outside the timing: a user's second run has it cached
    with Store(db) as store:
        on_step("ingest into a new store")
        t0 = time.perf_counter()
        first = ingest(store, [root], tokenizer)
        first_s = time.perf_counter() - t0
        on_step("ingest again")
        t0 = time.perf_counter()
        again = ingest(store, [root], tokenizer)
        again_s = time.perf_counter() - t0
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        tokenizer_id = store.tokenizer_id(tokenizer.fingerprint)
        t0 = time.perf_counter()
        index = load_index(store, tokenizer_id)
        load_s = time.perf_counter() - t0
        stats = store.stats()
    folder_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return {
        "files": first.files, "calls": first.calls, "tokens": index.num_tokens, "errors": len(first.errors),
        "ingest_s": first_s, "reingest_s": again_s, "reingest_new_calls": again.new_calls,
        "store_bytes": stats["disk_bytes"], "log_bytes": stats["raw_log_bytes"], "folder_bytes": folder_bytes,
        "store_vs_logs": stats["disk_bytes"] / max(stats["raw_log_bytes"], 1),
        "store_vs_folder": stats["disk_bytes"] / max(folder_bytes, 1),
        "index_load_s": load_s,
    }


def reference_figures(train: list[np.ndarray], test: list[np.ndarray], contexts: list[np.ndarray],
                      continuations: list[list[int]], *, max_depth: int, max_spec_tokens: int) -> dict[str, Any]:
    """The same figures as specx's, where the reference has them (it cannot save or load),
    measured and summarised by the benchmark's own code, as specx's are."""
    c = reference_module()
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
