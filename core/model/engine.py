"""What decoding asks of a model, whatever runs it: the Engine and its per-request Session.

Each engine implements it in its own wing: core.model.transformers.engine.TransformersEngine (a
transformers model: tree passes, a prefix cache of recent prompts, specx's kernels),
core.model.llamacpp.LlamaModel (a GGUF file on llama.cpp: best paths only, its one KV sequence
reused from request to request), and specx's own over core.model.sessions.SessionEngine (its
Session, batched passes): the quantized engine (core.model.quantized.engine.QuantEngine) and the GPU
one (core.model.gpu.engine.GPUEngine). Everything that differs between them is answered here, by
the engine itself; the decode loop's one verifier for all is core.decode.verifiers.model.ModelVerifier.

    engine, tokenizer = load_backend("smollm2-135m", backend="llama.cpp")   # core.model.load
    session = engine.start(prompt_ids[:-1])        # prefilled (the cached prefix reused)
    logits = session.score([prompt_ids[-1]], draft)  # [1 + N, V]: row 0 predicts the roots
    session.keep_path(accepted_nodes)              # the cache holds the accepted path
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ..draft import Draft
    from .prefix_cache import PrefixCache
    from .threads import ThreadTuner


class Session(Protocol):
    """One request's sequence in an engine's KV cache: each pass scores the pending tokens (in
    the sequence, not yet in the cache) and a draft, then keeps the accepted path."""

    def score(self, pending: list[int], draft: Draft) -> torch.Tensor:
        """Run pending + draft through the model, appending them to the cache; logits [1 + N, V]:
        row 0 (the last pending token's) predicts the draft's roots, row 1 + i node i's children."""
        ...

    def keep_path(self, accepted_nodes: list[int]) -> None:
        """After `score`: keep the pending tokens and these nodes (root to leaf) in the cache,
        as plain decoding would hold them, and drop the rest of the draft."""
        ...


class Engine(Protocol):
    """A model as the decode loop, the server and the command line see it.

    `name`: what runs it ("transformers", "llama.cpp"); `vocab_size`: the ids a draft may hold;
    `context_length`: the longest prompt + output; `precision`: what its numbers are, in words;
    `kernels`: specx's kernels it runs (on transformers core.model.transformers.kernels'; none on llama.cpp);
    `tree_unsupported`: why it verifies linear drafts only (each tree's best path), None when it
    verifies trees; `device`: where its passes run (torch's device type: "cpu", "cuda", ...);
    `prompt_lookup`: whether transformers' prompt lookup decoding runs on it (a baseline `plain`
    can run); `cost_curve`: the shipped cost curve (core.cost.shipped, by name) whose shape its
    passes' cost starts from; `hit_tokens`: prompt tokens `start` found already
    cached, over the engine's life (the server reports each request's share); `batches`: whether
    several requests' passes run as one (core.serve.batch: batch-invariant kernels, a KV cache per
    session, `start_steps` and its `forward_batch`); `compile_seconds`: how long its
    kernels took to compile at load (None where it compiles none); `tuner`: what chooses its passes'
    thread count (`tune_threads`; None until then, and where there is nothing to choose)."""

    name: str
    vocab_size: int
    context_length: int
    precision: str
    kernels: Sequence[str]
    tree_unsupported: str | None
    device: str
    prompt_lookup: bool
    cost_curve: str
    hit_tokens: int
    batches: bool
    compile_seconds: float | None
    tuner: ThreadTuner | None

    def start(self, tokens: Sequence[int], prefix_cache: PrefixCache | None = None) -> Session:
        """A request's sequence holding `tokens` (a prompt but its last token): its longest cached
        prefix reused (from `prefix_cache` on transformers; llama.cpp keeps its own), the rest
        prefilled; the hits are counted in `hit_tokens`."""
        ...

    def new_prefix_cache(self, max_tokens: int) -> PrefixCache | None:
        """A prefix cache of recent prompts for this engine's requests (None where the engine
        reuses prefixes on its own)."""
        ...

    def clear(self) -> None:
        """Forget what the engine holds between requests: the next one prefills its whole prompt."""
        ...

    def tune_threads(self, shape: Callable[[int, int], float] | None = None,
                     say: Callable[[str], None] | None = None) -> ThreadTuner | None:
        """From now on its passes choose their thread count (between the engine's and one) from their
        times: `tuner`, a core.model.threads.ThreadTuner, one for every session and request, each pass
        run inside its `timed` and its time normalised by `shape(rows, context)` (a cost's shape);
        `say` hears a switch. Called again, the same tuner takes the shape and `say` given (None:
        keeps its own). None (and nothing tuned) where there is nothing to choose: a GPU, one thread."""
        ...

    def cost_key(self) -> dict[str, Any]:
        """What its forward passes' cost depends on besides the machine (weights, dtype, engine
        build): the key under which a learned cost curve is kept."""
        ...

    def plain(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
              prefix_cache: PrefixCache | None = None, lookup: int | None = None) -> list[int]:
        """Greedy decoding by the engine's own generator (the baseline specx is compared with):
        transformers' `generate` (with its prompt lookup of `lookup` tokens when asked) or
        llama.cpp's one token per pass."""
        ...
