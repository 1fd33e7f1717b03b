"""A GGUF model on llama.cpp (llama-cpp-python) as an Engine (core.model.engine).

    model = LlamaModel("SmolLM2-135M-Instruct.Q4_1.gguf")
    steps = generate(model, prompt_ids, SuffixDrafter(), Decoding(max_new_tokens=64, eos_token_ids=[2]))

llama.cpp holds one sequence in its KV cache: the tokens of the last request (`LlamaModel.cached`).
A new request keeps the longest prefix it shares with them and prefills the rest (an agent's
conversation grows turn by turn, so its prefix is the last turn's). Each step runs the pending token
and the draft in one `llama_decode` batch with logits for every row; the rows go through the same
judge as the transformers engine's (core.decode.verify.judge: grammar masks, sampling, logprobs), and the
cache is cut back to the accepted tokens.

Drafts are verified as their best path (`linear`), not as trees: on llama.cpp's CPU backend a pass
costs nearly in proportion to its tokens (the built-in Q4_1 model on the 2-core AVX2 machine: 1
token 16 ms, 4 tokens 43 ms, 16 tokens 145 ms), so every branch a tree adds costs as much as a
token of the path, and the cost-aware sizing keeps few of them anyway. The tokens llama.cpp itself
would write are those of `greedy` (its prompt in one batch, then one token per pass).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .threads import ThreadTuner, retune, timed

N_BATCH = 512  # at most this many tokens per llama_decode call
N_CTX = 4096  # the context made when none is asked for: llama.cpp makes its KV cache whole at start
# Exactness: with an F16 or F32 KV cache, llama.cpp's CPU flash attention takes other code paths
# for one query row over 512+ cells (the cells split between the threads, then reduced: the result
# depends on the thread count) and for 64+ rows (tiles) than for a few rows, and their roundings
# differ (logits up to ~0.8 apart on the built-in model); so one-token decoding and a draft's pass
# disagree now and then. With a Q8_0 (or BF16) KV cache every pass takes the one row-by-row path,
# and a row's logits are the same bits however the tokens were batched and on any thread count.
# Q8_0 is the default: exact, and the fastest here (plain decoding 87 tokens/s against 76 on F16).
CACHE_TYPES = {"q8_0": 8, "bf16": 30, "f16": 1}  # name -> ggml type (llama-cpp-python's GGML_TYPE_*)
_LOG_SINK: Any = None  # llama.cpp's log callback (kept alive while the library may call it)


class LlamaError(RuntimeError):
    """llama.cpp could not load the model or run a pass (the message says which and why)."""


def available() -> bool:
    """Whether llama-cpp-python is installed (found without importing it)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def _library() -> Any:
    global _LOG_SINK
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaError(f"llama.cpp needs llama-cpp-python (make setup installs it): {exc}") from None
    if _LOG_SINK is None:  # llama.cpp logs every load to stderr; specx reports what matters itself
        _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def file_digest(path: Path) -> str:
    """What identifies a model file: its resolved name, size and modification time, hashed."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


class LlamaModel:
    """A GGUF file loaded by llama.cpp, with one sequence in its KV cache (`cached`: the tokens it
    holds, in order): an Engine (core.model.engine) that is its own Session, since llama.cpp holds
    one sequence; drafts are verified as their best path (`tree_unsupported`).
    """

    name = "llama.cpp"
    batches = False
    compile_seconds = None
    tuner: ThreadTuner | None = None
    tree_unsupported = "on llama.cpp a pass costs nearly in proportion to its tokens (core/model/llamacpp.py)"
    prompt_lookup = False  # transformers' prompt lookup does not run here (llama.cpp's own: examples/llamacpp_bench.py)
    kernels = ()  # specx's kernels are transformers'
    device = "cpu"  # llama-cpp-python's CPU build (the recipe's: no GPU offload)
    cost_curve = "llamacpp"  # a pass costs nearly in proportion to its tokens

    def __init__(self, path: str | Path, n_ctx: int | None = None, threads: int | None = None,
                 cache_type: str = "q8_0") -> None:
        if cache_type not in CACHE_TYPES:
            raise LlamaError(f"unknown KV cache type {cache_type!r}; choose from {', '.join(CACHE_TYPES)}")
        lib = self.lib = _library()
        self.cache_type = cache_type
        self.path = Path(path)
        if not self.path.is_file():
            raise LlamaError(f"no such GGUF file: {self.path}")
        self.model = lib.llama_model_load_from_file(str(self.path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise LlamaError(f"llama.cpp cannot load {self.path} (not a GGUF model it knows)")
        trained = int(lib.llama_model_n_ctx_train(self.model))
        n_ctx = n_ctx or N_CTX
        self.n_ctx = min(n_ctx, trained) if trained > 0 else n_ctx
        self.threads = threads or os.cpu_count() or 1
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = self.n_ctx, N_BATCH, N_BATCH, 1
        params.n_threads = params.n_threads_batch = self.threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED  # quantized KV cells need it
        params.type_k = params.type_v = CACHE_TYPES[cache_type]
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise LlamaError(f"llama.cpp cannot make a context of {self.n_ctx} tokens for {self.path}")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, desc, len(desc))
        self.description = desc.value.decode(errors="replace")
        self.context_length = self.n_ctx
        self.precision = f"{cache_type} KV cache"
        self.cached: list[int] = []
        self.hit_tokens = 0  # prompt tokens `start` found in the cache (as PrefixCache counts them)
        self._kept = 0  # entries before the draft's in the last pass: the cache + the pending tokens

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def digest(self) -> str:
        """What identifies this model file (file_digest)."""
        return file_digest(self.path)

    def set_threads(self, n: int) -> None:
        """Run the next passes on n threads."""
        self.lib.llama_set_n_threads(self.ctx, n, n)

    # ------------------------------------------------------------ the Engine (core.model.engine)

    def start(self, tokens: Sequence[int], prefix_cache: Any = None) -> LlamaModel:
        """The cache's longest prefix that `tokens` starts with kept (its length counted in
        `hit_tokens`), the rest prefilled; `prefix_cache` is transformers' (llama.cpp keeps its own)."""
        kept = self.reuse(tokens)
        self.hit_tokens += kept
        if kept < len(tokens):
            self.forward(tokens[kept:])
        return self

    def score(self, pending: list[int], draft: Any) -> Any:
        """Logits [1 + N, V] of the last pending token and each node of a linear draft, all appended."""
        import torch

        self._kept = len(self.cached) + len(pending)
        with timed(self.tuner, len(pending) + len(draft), len(self.cached)):
            return torch.from_numpy(self.forward(pending + list(draft.token_ids), logits_from=len(pending) - 1))

    def keep_path(self, accepted_nodes: list[int]) -> None:
        self.keep(self._kept + len(accepted_nodes))  # linear drafts: the accepted nodes lead

    def new_prefix_cache(self, max_tokens: int) -> None:
        return None  # `start` reuses the one sequence's prefix

    def clear(self) -> None:
        self.keep(0)

    def tune_threads(self, shape: Callable[[int, int], float] | None = None,
                     say: Callable[[str], None] | None = None) -> ThreadTuner | None:
        """core.model.engine.Engine.tune_threads: between its threads and one (llama.cpp's own pool)."""
        self.tuner = retune(self.tuner, self.threads, self.set_threads, shape, say)
        return self.tuner

    def cost_key(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"engine": self.name, "file": self.digest(), "cache_type": self.cache_type,
                "llama_cpp": version("llama-cpp-python")}

    def plain(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None, *,
              prefix_cache: Any = None, lookup: int | None = None) -> list[int]:
        if lookup:
            raise ValueError("prompt lookup runs on transformers; on llama.cpp: plain decoding and specx")
        return greedy(self, prompt, max_new_tokens, [] if eos_token_id is None else [eos_token_id])

    def keep(self, n: int) -> None:
        """Drop the KV entries past the first `n` tokens."""
        if n < len(self.cached):
            self.lib.llama_memory_seq_rm(self.memory, 0, n, -1)
            del self.cached[n:]

    def reuse(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix of the cache that `tokens` starts with; returns its length."""
        common = 0
        for a, b in zip(self.cached, tokens):
            if a != b:
                break
            common += 1
        self.keep(common)
        return common

    def forward(self, tokens: Sequence[int], logits_from: int | None = None) -> np.ndarray:
        """Append `tokens` to the cache and return the logits of rows logits_from.. ([rows, V]
        float32; none when logits_from is None): one llama_decode call per N_BATCH tokens."""
        tokens = [int(t) for t in tokens]
        if len(self.cached) + len(tokens) > self.n_ctx:
            raise LlamaError(f"the context of {self.n_ctx} tokens is full ({len(self.cached)} cached + "
                             f"{len(tokens)} new)")
        lib, batch, rows = self.lib, self.batch, []
        start = 0
        while start < len(tokens):
            pos0, end = len(self.cached), start + N_BATCH
            chunk = tokens[start:end]
            batch.n_tokens = len(chunk)
            wanted = 0
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + i, 1
                batch.seq_id[i][0] = 0
                out = logits_from is not None and start + i >= logits_from
                batch.logits[i] = out
                wanted += out
            code = lib.llama_decode(self.ctx, batch)
            if code != 0:
                self.keep(pos0)
                raise LlamaError(f"llama_decode failed ({code}) on {len(chunk)} tokens at position {pos0}")
            self.cached.extend(chunk)
            if wanted:
                rows.append(np.ctypeslib.as_array(lib.llama_get_logits(self.ctx),
                                                  shape=(wanted, self.vocab_size)).copy())
            start = end
        return np.concatenate(rows) if rows else np.empty((0, self.vocab_size), dtype=np.float32)


def greedy(model: LlamaModel, prompt: Sequence[int], max_new_tokens: int, eos: Iterable[int] = ()) -> list[int]:
    """llama.cpp's own greedy decoding, as llama-cpp-python's `Llama.generate` runs it: the whole
    prompt in one batch (the longest cached prefix kept), then one token per pass, the argmax of
    each row: the reference specx on llama.cpp must equal."""
    eos = set(eos)
    prompt = [int(t) for t in prompt]
    kept = min(model.reuse(prompt), len(prompt) - 1)  # at least the last prompt token is run again
    model.keep(kept)
    row = model.forward(prompt[kept:], logits_from=len(prompt) - kept - 1)[-1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = int(row.argmax())
        out.append(tok)
        if tok in eos or len(out) == max_new_tokens:
            break
        row = model.forward([tok], logits_from=0)[0]
    return out
