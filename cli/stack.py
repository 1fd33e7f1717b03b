"""The one assembly of what decoding with a model needs, from the command line's options: engine,
tokenizer and chat template (the engine's threads tuned), the global index, the forward-pass
cost, the drafter, the prefix cache (a core.decode.stack.Stack). `specx serve`, `specx generate`,
`specx replay --model` and the benches build theirs here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .home import model_cost, specx_home

if TYPE_CHECKING:
    from .core.decode.stack import Stack
    from .core.index.successors import SuccessorTable
    from .store.db import Store


DRAFTERS = ("suffix", "table", "hybrid")  # --drafter's choices (assemble builds them)


class SettingError(ValueError):
    """An option found wrong by what the commands call (serve's settings, or once the model is
    loaded, replay's and generate's); `option` names it, as the command's usage error does."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def default_drafter(engine: Any) -> str:
    """What serve, generate and replay --model draft with unless told on `engine` (a
    core.model.engine.Engine): the hybrid where it verifies trees on an accelerator (an H200: 1.23x
    the suffix index's tokens/s on text-to-SQL 0-shot, 1.03x 3-shot, 1.00x chat answers), else the
    suffix index. On a CPU the learned cost keeps few table nodes and the table's own work is not
    repaid: on the 2-core AVX-512 Xeon 0.96-1.00x the suffix index's tokens/s on text-to-SQL 0-shot
    in five runs, 0.99-1.04x on chat answers in four; on llama.cpp, whose passes cost in proportion
    to their tokens, 0.983x on average over ten runs (docs/benchmarks.md, sessions 35 and 36)."""
    return "hybrid" if engine.tree_unsupported is None and engine.device != "cpu" else "suffix"


def assemble(model: str, *, backend: str, dtype: str | None, say: Callable[[str], None],
             chat_template: str | None = None, check_template: bool = True, db: Path | None = None,
             create_store: bool = False, speculation: bool = True, cost_aware: bool = True,
             relearn: bool = False, max_spec_tokens: int = 32, max_spec_factor: float = 4.0,
             prefix_cache_tokens: int = 0, kv_memory: int | None = None, cache_dir: Path | None = None,
             drafter: str | None = None, context: int | None = None,
             stage: Callable[[str], None] = lambda what: None) -> Stack:
    """Load `model` on `backend` (auto: the engine chosen for this machine, specx.backends) in `dtype`,
    its sequences at most `context` tokens (core.model.load.load_backend's default: None), then build
    the chain in order, `say` hearing what was chosen:

    - the chat template: `chat_template` (a file or the template itself) given to the tokenizer,
      else its own checked (with `check_template`: raw text needs none);
    - the global index: the store at `db`'s outputs for this tokenizer (`create_store`: the store is
      made when missing, as the server writes what it serves; else no store means an empty index;
      no `db`: an empty index);
    - the forward-pass cost, learned from the passes (`cost_aware`; `relearn`: forgetting what
      earlier runs kept), the engine's threads tuned by its shape, and with `speculation` a SuffixDrafter of
      `max_spec_tokens` and `max_spec_factor` over the global index (`drafter`: suffix; table: the
      model's successor table alone, hybrid: both, core.decode.hybrid; None: the engine's default,
      specx.stack.default_drafter; the table is the store's, kept per model, else a new one);
    - a prefix cache where the engine takes one: `kv_memory` bytes of KV entries (said in tokens at
      the model's size; see kv_budget_tokens), else `prefix_cache_tokens` tokens.

    Converted models are kept in `cache_dir` (default $SPECX_HOME/models). `stage` hears each long
    step as it begins (the server's /health shows it)."""
    from .core.decode.hybrid import HybridDrafter, table_nodes
    from .core.decode.speculate import SuffixDrafter
    from .core.decode.stack import Stack
    from .core.index.successors import SuccessorTable
    from .core.index.suffix_index import SuffixIndex
    from .core.model.chat import use_chat_template
    from .core.model.load import load_backend, tokenizer_fingerprint
    from .store.successors import table_key

    from .backends import resolve_backend

    if drafter is not None and drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}: choose from {', '.join(DRAFTERS)}")
    engine, tokenizer = load_backend(model, cache_dir or specx_home() / "models", resolve_backend(model, backend, say),
                                     dtype=dtype, context=context)
    say(f"backend: {engine.name}" + (f" ({engine.precision}; kernels ready in {engine.compile_seconds:.0f} s)"
                                     if engine.compile_seconds is not None else ""))
    drafter = drafter or default_drafter(engine)
    if check_template or chat_template is not None:
        use_chat_template(tokenizer, chat_template, model)
    if speculation and engine.tree_unsupported:
        say(f"linear drafts (each tree's best path), not trees: {engine.tree_unsupported}")
    fingerprint, global_index, successors = tokenizer_fingerprint(tokenizer), SuffixIndex(), None
    if db is not None and (create_store or db.exists()):
        from .store.db import Store
        from .store.index import index_for

        stage("loading the global index")
        with Store(db, readonly="auto") as store:  # created when missing; read-only where it cannot be written
            global_index = index_for(store, fingerprint)
            if speculation and drafter != "suffix":
                successors = kept_table(store, table_key(Path(model).name, fingerprint), engine.vocab_size, say)
        say(f"global index: {global_index.num_tokens:,} tokens from {db}")
    # nothing is timed here: the cost is learned from the passes the requests run
    cost = model_cost(engine, model, say, relearn=relearn) if cost_aware else None
    suffix = SuffixDrafter(global_index, max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor) \
        if speculation and drafter != "table" else None
    if speculation and drafter != "suffix":
        successors = successors if successors is not None else SuccessorTable(engine.vocab_size)
        say(f"drafter: {drafter} (successor table: {len(successors):,} tokens with successors)")
        chosen = HybridDrafter(suffix, successors, max_nodes=table_nodes(engine.tree_unsupported))
    else:
        successors, chosen = None, suffix
        if speculation:
            say("drafter: suffix")
    if kv_memory is not None:
        prefix_cache_tokens = kv_budget_tokens(engine, kv_memory, say)
    prefix_cache = engine.new_prefix_cache(prefix_cache_tokens) if prefix_cache_tokens else None
    engine.tune_threads(cost.shape if cost is not None else None, say)  # its passes choose their threads
    return Stack(engine, tokenizer, fingerprint, global_index, drafter=chosen, cost=cost,
                 prefix_cache=prefix_cache, successors=successors,
                 successors_key=table_key(Path(model).name, fingerprint) if successors is not None else None)


def kv_budget_tokens(engine: Any, memory: int, say: Callable[[str], None]) -> int:
    """The tokens `memory` bytes of the engine's KV entries hold (each tenant gets its share), said
    in a line; 0 where the engine keeps its own cache (llama.cpp: its one sequence)."""
    from .core.model.prefix_cache import kv_bytes_per_token

    per_token = kv_bytes_per_token(engine)
    if per_token <= 0:
        return 0
    tokens = int(memory // per_token)
    say(f"conversation memory: {memory / 2**30:.2f} GiB of KV entries = {tokens:,} tokens at "
        f"{per_token / 1024:.1f} KiB a token (the conversation expected back last out first)")
    return tokens


def default_kv_memory() -> int:
    """A quarter of this machine's free memory (the live requests' caches are sized from half:
    core.serve.batch.default_max_batch); 2 GiB where it cannot be read."""
    from .core.model.prefix_cache import free_memory

    free = free_memory()
    return 2 << 30 if free is None else free // 4


def kept_table(store: Store, key: str, vocab_size: int, say: Callable[[str], None]) -> SuccessorTable | None:
    """The successor table the store keeps for this model, or None (none kept, or a damaged one: said,
    and a new table replaces it at the next save)."""
    from .store.db import StoreError
    from .store.successors import load_table

    try:
        return load_table(store, key, vocab_size)
    except StoreError as exc:
        say(f"warning: {exc}; starting a new successor table")
        return None


def keep_successors(stack: Stack, db: Path | None, say: Callable[[str], None]) -> None:
    """Keep the stack's successor table (if it has one) in the store at `db` (if there is one), so
    the next run starts warm; a failure is said, not raised (the answer is out already)."""
    if stack.successors is None or stack.successors_key is None or db is None or not db.exists():
        return
    from .store.db import Store, StoreError
    from .store.successors import save_table

    try:
        with Store(db) as store:
            save_table(store, stack.successors_key, stack.successors)
    except (StoreError, OSError) as exc:
        say(f"warning: could not keep the successor table in {db}: {exc}")
