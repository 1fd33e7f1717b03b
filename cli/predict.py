"""The figures behind `specx entropy` (the outputs' entropy per group, the predictor) and the projection
behind `specx replay`: store to core.predict.estimate.

The prediction replays a sample of the selected calls with the history a full `specx replay`
would give them (core/predict/estimate.py says why that is exact per call), with replay's default
settings, so the two can be compared figure for figure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import typer

from .core.predict.curves import CostCurve, PredictError, builtin_curves, load_cost_curve
from .core.predict.estimate import learning_curve, predict_groups, projected_speedup, replay_sample
from .core.predict.sampling import draw_stratified
from .store.prompts import iter_prompt_tokens
from .store.selection import PromptMessages

from . import output
from .home import specx_home
from .stack import SettingError

if TYPE_CHECKING:
    from .core.predict.methods import MethodReplays

# `specx replay`'s defaults (model-free): what the prediction predicts (tests check they agree).
REPLAY_DEFAULTS = {"max_spec_tokens": 32, "max_spec_factor": 1.0, "min_token_prob": 0.1, "max_depth": 64,
                   "tree": True, "merge": True, "prompt_window": 4096}
DEFAULT_SAMPLE_CALLS = 200
SAMPLINGS = {"weighted": 0.5, "calls": 0.0}  # --sampling: a call's chance ~ tokens ** power
CURVE_POINTS = 10  # a learning curve's window: a tenth of the sampled calls...
CURVE_WINDOW_MIN = 5  # ...and at least this many


def fail(message: str) -> typer.Exit:
    """A user error: one line on stderr, exit status 1."""
    output.error(message)
    return typer.Exit(1)


def sample_size(sample_calls: int | None, selected: int) -> int:
    """The calls to draw: --sample-calls (no more than the selection holds), else the default."""
    if sample_calls is not None and sample_calls > selected:
        raise fail(f"--sample-calls {sample_calls:,} is more than the {selected:,} calls selected "
                   f"(leave it out to replay every call of a selection this small)")
    return min(sample_calls or DEFAULT_SAMPLE_CALLS, selected)


def cost_curves(files: Sequence[Path] | None) -> list[CostCurve]:
    """The shipped curves ("flat", "cpu") and the user's files (named by file stem)."""
    curves = builtin_curves()
    for path in files or []:
        try:
            curve = load_cost_curve(path)
        except PredictError as exc:
            raise fail(str(exc)) from None
        if curve.name in curves:
            raise fail(f"cost curve {path}: the name {curve.name!r} is taken (a curve is named by its file's "
                       f"stem; rename the file)")
        curves[curve.name] = curve
    return list(curves.values())


def speedups_cell(by: dict[str, Any]) -> str:
    """A table cell: "2.50x / 1.80x", the speedup over plain decoding / over prompt lookup ("-": none)."""
    return " / ".join("-" if by.get(k) is None else f"{by[k]:.2f}x" for k in ("vs_plain", "vs_prompt_lookup"))


def curves_json(curves: Sequence[CostCurve]) -> dict[str, Any]:
    return {c.name: {"about": c.about, "cost": c.points()} for c in curves}


def stored_calls(store: Any, fingerprint: str, tokenizer: str, **selection: Any) -> tuple[int, list[Any]]:
    """(tokenizer id, the calls `selection` picks: store.selection.select_calls) for the tokenizer
    with this fingerprint; SettingError naming the option when the store has no tokens for it or
    nothing matches (entropy and replay)."""
    from .store.selection import select_calls

    tokenizer_id = store.tokenizer_id(fingerprint)
    if tokenizer_id is None:
        raise SettingError("--tokenizer", f"the store has no tokens for {tokenizer!r}: ingest with --model {tokenizer}")
    calls = select_calls(store, tokenizer_id, **selection)
    if not calls:
        raise SettingError("--format/--source/...", "no stored call matches the selection")
    return tokenizer_id, calls


def entropy_selection(path: Path, tokenizer: str, selection: dict[str, Any], *, by: str, sample: int | None,
                      seed: int, max_depth: int, predict: bool, curves: Sequence[CostCurve],
                      sample_calls: int | None, sampling: str
                      ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """(a row per group, the overall row, the prediction) for the calls `selection` picks in the
    store at `path`, from `tokenizer`'s stored tokens, grouped `by`: each group's empirical entropy
    over contexts of 1 to `max_depth` tokens (of `sample` outputs drawn at random, when given) and,
    with `predict`, predict_selection's figures on `curves` added to each row."""
    from .core.model.load import load_tokenizer, tokenizer_fingerprint
    from .core.predict.entropy import empirical_entropy
    from .store.db import Store

    tok = load_tokenizer(tokenizer, specx_home() / "models")
    rng = np.random.default_rng(seed)
    with Store(path, readonly="auto") as store:
        tokenizer_id, calls = stored_calls(store, tokenizer_fingerprint(tok), tokenizer, **selection)
        groups: dict[str, list] = {}
        for call in calls:
            groups.setdefault(call.group(by), []).append(call)
        rows = []
        everything = []
        for key, members in sorted(groups.items()):
            if sample is not None and len(members) > sample:
                members = [members[i] for i in sorted(rng.choice(len(members), size=sample, replace=False))]
            tokens = [store.call_tokens(c.id, tokenizer_id) for c in members]
            everything += tokens
            rows.append({"key": key, **_entropy_row(empirical_entropy(tokens, max_depth=max_depth), len(members))})
        overall = {"key": "overall", **_entropy_row(empirical_entropy(everything, max_depth=max_depth),
                                                    sum(r["calls"] for r in rows))}
        prediction = None
        if predict:
            n = sample_size(sample_calls, len(calls))
            output.note(f"predicting: replaying about {n:,} of {len(calls):,} calls (drawn within each {by}) with "
                        "their history")
            with output.progress() as bar:
                task = bar.add_task("predict", total=n)
                prediction = predict_selection(store, tok, tokenizer_id, calls, by=by, curves=curves,
                                               sample_calls=sample_calls, seed=seed, sampling=sampling,
                                               on_call=lambda: bar.advance(task),
                                               on_sample=lambda k: bar.update(task, total=k))
            for row in rows:
                row.update(prediction["groups"][row["key"]])
            overall.update(prediction["overall"])
    return rows, overall, prediction


def _entropy_row(result: Any, calls: int) -> dict[str, Any]:
    return {"calls": calls, "tokens": result.num_tokens, "entropy_bits": result.entropy_bits,
            "order_bits": result.order_bits, "contexts": result.num_contexts}


def predict_selection(store: Any, tokenizer: Any, tokenizer_id: int, calls: list, *, by: str,
                      curves: Sequence[CostCurve], sample_calls: int | None, seed: int, sampling: str = "weighted",
                      params: dict[str, Any] | None = None,
                      on_call: Callable[[], None] = lambda: None,
                      on_sample: Callable[[int], None] = lambda calls: None) -> dict[str, Any]:
    """{"overall": {...}, "groups": {key: {...}}, "sample": {...}} for `calls` (stored order);
    `on_sample(n)` once the n calls to replay are drawn, `on_call()` after each is replayed."""
    from .core.predict import methods as replay_lib

    params = params or REPLAY_DEFAULTS
    started = time.perf_counter()
    n = sample_size(sample_calls, len(calls))
    outputs = [store.call_tokens(c.id, tokenizer_id) for c in calls]
    groups = [c.group(by) for c in calls]
    samples = draw_stratified([len(o) for o in outputs], groups, n, seed, SAMPLINGS[sampling])
    positions = sorted({i for part in samples.values() for i in part.hits})
    on_sample(len(positions))
    chosen = [calls[i] for i in positions]
    prompts = Prefetched(iter_prompt_tokens(PromptMessages(store, chosen), tokenizer, chosen,
                                                       params["prompt_window"]), len(chosen))
    replayed = replay_sample(outputs, groups, positions, prompts, lambda: replay_lib.make_drafter("specx", params),
                             make_prompt_lookup=lambda: replay_lib.make_drafter("prompt_lookup", params),
                             curves=curves, on_call=on_call)
    sizes: dict[str, int] = {}
    for key in groups:
        sizes[key] = sizes.get(key, 0) + 1
    names = [c.name for c in curves]
    overall, by_group = predict_groups(samples, replayed, sizes, names)
    window = max(CURVE_WINDOW_MIN, len(positions) // CURVE_POINTS)
    return {"overall": overall.to_json(), "groups": {k: p.to_json() for k, p in by_group.items()},
            "sample": {"calls": len(positions), "draws": sum(len(p.hits) for p in samples.values()),
                       "sampling": sampling, "seed": seed, "by": by,
                       "exhaustive": all(p.exhaustive for p in samples.values()),
                       "seconds": time.perf_counter() - started,
                       "interval": "value +- 1.96 standard errors of the (combined) ratio estimator",
                       "params": params, "curves": curves_json(curves)},
            "learning_curve": learning_curve(replayed, samples, window=window),
            "group_curves": {key: learning_curve([c for c in replayed if c.group == key], samples, window=window)
                             for key in sizes}}


class Prefetched(Sequence):
    """The items of an iterator, produced by a thread of their own while the caller goes on;
    `[j]` waits for item j (and raises what the thread raised). The walk of the sample needs the
    sampled calls' prompts one at a time, in order, and tokenizing them (Rust, GIL-free) then runs
    beside the walk's index build and replays (docs/predict.md, "Time")."""

    def __init__(self, items: Iterator[Any], length: int) -> None:
        self._items: list[Any] = []
        self._length, self._error = length, None
        self._ready = threading.Condition()
        threading.Thread(target=self._run, args=(items,), name="specx-prefetch", daemon=True).start()

    def _run(self, items: Iterator[Any]) -> None:
        try:
            for item in items:
                with self._ready:
                    self._items.append(item)
                    self._ready.notify_all()
        except BaseException as exc:  # handed to the reader, who raises it
            self._error = exc
        with self._ready:
            if self._error is None:
                self._length = len(self._items)  # the iterator's end is the sequence's
            self._ready.notify_all()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, j: int) -> Any:  # type: ignore[override]
        with self._ready:
            self._ready.wait_for(lambda: j < len(self._items) or self._error is not None or
                                 j >= self._length)
            if j < len(self._items):
                return self._items[j]
            if self._error is not None:
                raise self._error
            raise IndexError(j)


def plot(prediction: dict[str, Any], by: str, path: Path) -> None:
    """The learning curve: tokens per step of the sampled calls (rolling, weighted as the estimate
    weighs them) against the output tokens the global index held when each started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = prediction["group_curves"]
    if len(groups) > 1:
        for key, points in sorted(groups.items()):
            if len(points) >= 2:
                ax.plot([h for h, _ in points], [t for _, t in points], linewidth=1.0, alpha=0.7, label=f"{by} {key}")
    points = prediction["learning_curve"]
    ax.plot([h for h, _ in points], [t for _, t in points], color="black", linewidth=2.0, label="all selected")
    overall = prediction["overall"]["predicted_tokens_per_step"]
    if overall is not None:
        ax.axhline(overall, color="black", linestyle=":", linewidth=1.0, label=f"predicted overall {overall:.2f}")
    ax.set_xlabel("history: output tokens in the global index when the call started")
    ax.set_ylabel("tokens per step (rolling over sampled calls)")
    ax.set_title(f"learning curve ({prediction['sample']['calls']} sampled calls)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def project_replay(calls: list, prompts: list[np.ndarray], outputs: list[np.ndarray], *, warm: list[np.ndarray],
                   params: dict[str, Any], by: str, curves: Sequence[CostCurve], result: MethodReplays,
                   on_call: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """`specx replay`'s projected speedups from its own replay of every call: {"overall": {curve:
    {...}}, "groups": {key: {curve: {...}}}}. Uses the replay's measured steps (specx and, when
    replayed, prompt lookup) for flat curves; replays with drafts cut to what pays for the others."""
    from .core.predict import methods as replay_lib

    curve_steps = {m: r.curve for m, r in result.results.items()}  # a core.predict.methods.MethodReplays
    specx_steps = [s for _, s in curve_steps["specx"]] if "specx" in curve_steps else None
    lookup_steps = [s for _, s in curve_steps["prompt_lookup"]] if "prompt_lookup" in curve_steps else None
    groups = [c.group(by) for c in calls]
    replayed = replay_sample(outputs, groups, list(range(len(calls))), prompts,
                             lambda: replay_lib.make_drafter("specx", params),
                             make_prompt_lookup=lambda: replay_lib.make_drafter("prompt_lookup", params),
                             curves=curves, warm=warm,
                             unsized=False, specx_steps=specx_steps, lookup_steps=lookup_steps, on_call=on_call)
    names = [c.name for c in curves]
    keys = sorted(set(groups))
    return {"overall": projected_speedup(replayed, names),
            "groups": {k: projected_speedup([c for c in replayed if c.group == k], names) for k in keys}}
