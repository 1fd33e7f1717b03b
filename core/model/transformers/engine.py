"""A transformers model as an Engine (core.model.engine): tree passes (tree.py), the prefix cache of
recent prompts (prefix_cache.py), torch's and numba's threads; and transformers' own greedy
decoding, the baseline.

    engine = TransformersEngine(model)          # load_backend returns one
    session = engine.start(prompt_ids[:-1], engine.new_prefix_cache(8192))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from ...draft import Draft, check_draft
from ..prefix_cache import PrefixCache
from ..threads import ThreadTuner, retune, set_threads, timed
from .kv_cache import cache_kwarg, new_cache
from .prefix_cache import TransformersPrefixCache
from .tree import keep_accepted, tree_logits, tree_unsupported


class TransformersSession:
    """One request's KV cache (`cache`) on a transformers model: each pass a tree pass
    (core.model.transformers.tree.tree_logits; best paths through the model's own masks when
    `linear` says why it cannot take trees), then the cache pruned to the accepted path."""

    def __init__(self, model: Any, cache: Any, *, linear: str | None = None, tuner: ThreadTuner | None = None) -> None:
        self.model, self.cache, self.linear, self.tuner = model, cache, linear, tuner
        self.vocab_size = model.config.vocab_size
        self._kept = 0  # entries before the draft's in the last pass: the cache + the pending tokens
        self._nodes = 0  # the last pass's draft nodes

    def score(self, pending: list[int], draft: Draft) -> torch.Tensor:
        check_draft(draft, self.vocab_size)
        cached = self.cache.get_seq_length()
        self._kept, self._nodes = cached + len(pending), len(draft)
        with timed(self.tuner, len(pending) + len(draft), cached):
            return tree_logits(self.model, self.cache, pending, draft, linear=self.linear)[len(pending) - 1 :]

    def keep_path(self, accepted_nodes: list[int]) -> None:
        keep_accepted(self.cache, self._kept, accepted_nodes, self._nodes)


class TransformersEngine:
    """A transformers model (`model`, in eval mode) as an Engine; core.model.load.load_backend makes one."""

    name = "transformers"
    batches = False
    compile_seconds = None
    prompt_lookup = True
    cost_curve = "cpu"  # the built-in model's passes on a CPU
    tuner: ThreadTuner | None = None

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.context_length = int(model.config.max_position_embeddings)
        self.precision = str(model.dtype).removeprefix("torch.")
        self.kernels = list(getattr(model, "specx_kernels", []))
        self.tree_unsupported = tree_unsupported(model)
        self.device = model.device.type
        self.hit_tokens = 0

    def start(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None) -> TransformersSession:
        prefixes = prefix_cache if prefix_cache is not None else TransformersPrefixCache(0)
        hits = prefixes.hit_tokens
        cache = prefixes.prefill(self.model, tokens)
        self.hit_tokens += prefixes.hit_tokens - hits
        return TransformersSession(self.model, cache, linear=self.tree_unsupported, tuner=self.tuner)

    def new_prefix_cache(self, max_tokens: int) -> TransformersPrefixCache:
        return TransformersPrefixCache(max_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        """What one position's keys and values take in its caches, over all layers (from the model's
        config and dtype; 0 for a config that does not say)."""
        config = self.model.config
        if not hasattr(config, "num_hidden_layers"):
            return 0
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        size = torch.empty((), dtype=getattr(self.model, "dtype", torch.float32)).element_size()
        return int(config.num_hidden_layers) * 2 * kv_heads * head_dim * size

    def clear(self) -> None:
        """Nothing is held between requests (the prefix caches are the callers')."""

    def tune_threads(self, shape: Callable[[int, int], float] | None = None,
                     say: Callable[[str], None] | None = None) -> ThreadTuner | None:
        """core.model.engine.Engine.tune_threads: between torch's threads and one (on a CPU)."""
        threads = torch.get_num_threads() if self.model.device.type == "cpu" else 1
        self.tuner = retune(self.tuner, threads, set_threads, shape, say)
        return self.tuner

    def cost_key(self) -> dict[str, Any]:
        model, device = self.model, str(self.model.device)
        return {"model_type": getattr(model.config, "model_type", None),
                "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype), "device": device,
                "gpu": torch.cuda.get_device_name(model.device) if device.startswith("cuda") else None,
                "kernels": self.kernels, "torch": torch.__version__}

    def plain(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
              prefix_cache: PrefixCache | None = None, lookup: int | None = None) -> list[int]:
        return hf_generate(self.model, prompt, max_new_tokens, eos_token_id, prompt_lookup_num_tokens=lookup,
                           prefix_cache=prefix_cache)


def hf_generate(model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
                prompt_lookup_num_tokens: int | None = None, stock_cache: bool = False,
                prefix_cache: TransformersPrefixCache | None = None) -> list[int]:
    """Greedy decoding by transformers' own `generate` (with its prompt lookup when asked), on the
    same KV cache class as specx (core.model.transformers.kv_cache.new_cache), so that only the
    decoding differs; `stock_cache`: on transformers' default cache instead. With `prefix_cache`,
    the prompt but its last token is prefilled through it first (transformers then runs only the
    last token)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    cache = DynamicCache() if stock_cache else new_cache(model)
    if prefix_cache is not None:
        cache = prefix_cache.prefill(model, prompt[:-1], cache)
    if prefix_cache is not None or not stock_cache:
        extra[cache_kwarg(model)] = cache
    if prompt_lookup_num_tokens and cache.get_seq_length():
        # transformers' assisted decoding runs its first pass over the whole prompt even when the
        # cache already holds all of it but the last token; run it over the uncached tokens only
        model.prepare_inputs_for_generation = partial(_uncached_first_pass, type(model).prepare_inputs_for_generation,
                                                      model)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id, **extra)
    finally:
        model.__dict__.pop("prepare_inputs_for_generation", None)
    return out[0, ids.shape[1] :].tolist()


def _uncached_first_pass(prepare: Callable[..., Any], model: Any, input_ids: torch.Tensor,
                         next_sequence_length: int | None = None, is_first_iteration: bool | None = False,
                         **kwargs: Any) -> Any:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.2x: `cache`
    if is_first_iteration and next_sequence_length is None and cache is not None:
        next_sequence_length = input_ids.shape[1] - cache.get_seq_length()
    return prepare(model, input_ids, next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration,
                   **kwargs)
