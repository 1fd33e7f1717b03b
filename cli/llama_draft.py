"""specx as llama-cpp-python's draft model: drafts from a specx store for `Llama(draft_model=...)`.

    from llama_cpp import Llama
    from specx.llama_draft import SpecxDraft

    draft = SpecxDraft("agents.db")          # warm: the store's outputs for this model's tokenizer
    llm = Llama(model_path="model.gguf", draft_model=draft, n_ctx=4096, logits_all=True)
    print(llm("SELECT", max_tokens=64, temperature=0)["choices"][0]["text"])
    draft.close()                            # stores what it generated and persists the index

llama-cpp-python calls the draft model before each pass with every token of the request so far (the
prompt and the accepted output) and verifies what it returns as one linear draft. SpecxDraft keeps
a core.decode.speculate.SuffixDrafter request in step with those calls: a sequence that does not extend
the last one starts a new request, and the finished one is learned into the global index (drafts
of later requests come from it at once) and handed to a store writer (store/served.py), which stores
it off the decode path and persists the index at `close`, so the next start is warm.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

try:  # llama-cpp-python's base class, where it is installed (its isinstance checks need it)
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError:  # pragma: no cover - documented: the class is for llama-cpp-python users
    LlamaDraftModel = object  # type: ignore[misc,assignment]


class SpecxDraft(LlamaDraftModel):
    """A llama-cpp-python draft model that drafts from a specx store (`db`: a path; None: an empty
    index that learns only from what it generates). `tokenizer`: the model whose tokenizer the
    store's tokens are for (a built-in name, .gguf file or HF folder: the GGUF's own tokenizer);
    `max_draft`: most tokens per draft (llama.cpp verifies them in one pass whose cost grows with
    them); `learn`: learn and store each finished request."""

    def __init__(self, db: str | Path | None = None, tokenizer: str = "smollm2-135m", max_draft: int = 8,
                 learn: bool = True) -> None:
        from .core.decode.speculate import SuffixDrafter
        from .core.draft import best_path
        from .core.index.suffix_index import SuffixIndex
        from .core.model.load import load_tokenizer, tokenizer_fingerprint

        self._best_path = best_path
        tok = load_tokenizer(tokenizer)
        index, self.writer = SuffixIndex(), None
        if db is not None:
            from .store.db import Store
            from .store.index import index_for
            from .store.served import ServedWriter

            fingerprint = tokenizer_fingerprint(tok)
            with Store(Path(db)) as store:
                index = index_for(store, fingerprint)
            if learn:
                self.writer = ServedWriter(Path(db), tokenizer, fingerprint, tokenizer, len(tok),
                                           lambda ids: tok.decode(ids.tolist(), skip_special_tokens=False),
                                           session_prefix=f"llama-{time.strftime('%Y%m%dT%H%M%S')}-"
                                                          f"{uuid.uuid4().hex[:6]}/", sync_s=0.0)
        self.index, self.max_draft, self.learn = index, max_draft, learn
        self.drafter = SuffixDrafter(index, max_spec_tokens=max_draft)
        self._seq: list[int] = []  # the tokens of the request in progress
        self._prompt_len = 0
        self.requests = 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> np.ndarray:
        ids = [int(t) for t in np.asarray(input_ids).tolist()]
        n = len(self._seq)
        if n and len(ids) >= n and ids[:n] == self._seq:
            self.drafter.extend(ids[n:])
        else:  # a new request: the first call comes after the first output token
            self._finish()
            self.drafter.start_request(ids[:-1])
            self.drafter.extend(ids[-1:])
            self._prompt_len = len(ids) - 1
            self.requests += 1
        self._seq = ids
        draft = self._best_path(self.drafter.speculate())
        return np.array(draft.token_ids[: self.max_draft], dtype=np.intc)

    def _finish(self) -> None:
        if not self._seq:
            return
        self.drafter.finish_request(self.learn)
        if self.writer is not None:
            from .store.served import ServedRequest

            prompt, output = self._seq[: self._prompt_len], self._seq[self._prompt_len :]
            self.writer.put(ServedRequest(f"r{self.requests}", np.array(prompt, dtype=np.int32),
                                          np.array(output, dtype=np.int32), {"engine": "llama.cpp"}))
        self._seq = []

    def close(self) -> None:
        """Learn and store the request in progress, persist the index (idempotent)."""
        self._finish()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
