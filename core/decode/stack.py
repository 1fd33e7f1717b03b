"""What decoding with a model needs besides a request, built once per run and shared by its
requests: the Stack (the command line's `assemble`, cli/stack.py, builds it from options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost.forward import PassCost
from ..index.successors import SuccessorTable
from ..index.suffix_index import SuffixIndex
from ..model.engine import Engine
from ..model.prefix_cache import PrefixCache
from .hybrid import HybridDrafter
from .speculate import SuffixDrafter


@dataclass(frozen=True)
class Stack:
    """The engine (core.model.engine.Engine) and its tokenizer (transformers', its chat template
    checked) with its fingerprint (core.model.load.tokenizer_fingerprint: what the store keys
    tokens by), the global index its drafter drafts from, the drafter (None: plain decoding), the
    forward-pass cost that sizes the drafts (None: whole drafts) and the prefix cache of recent
    prompts (None: each prompt prefilled whole, or the engine's own reuse): what `generate` takes
    besides a request. The engine chooses its passes' threads itself (Engine.tune_threads)."""

    engine: Engine
    tokenizer: Any
    fingerprint: str
    global_index: SuffixIndex
    drafter: SuffixDrafter | HybridDrafter | None = None
    cost: PassCost | None = None
    prefix_cache: PrefixCache | None = None
    successors: SuccessorTable | None = None  # the table the drafter drafts from and each pass teaches
    successors_key: str | None = None  # the key it is kept under in the store (store.successors.table_key)
