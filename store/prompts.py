"""Stored prompts as the model reads them: each call's prompt rendered with the tokenizer's chat
template and tokenized (the last `window` tokens), for replay, the predictor and the benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..core.model.chat import chatml_block, chatml_blocks, render_prompt

from .db import Store
from .selection import CallRef, PromptMessages, prompt_texts

CHARS_PER_TOKEN = 4  # about what a token covers in agent logs; prompt_tokens checks and redoes short ones


def prompt_tokens(store: Store | PromptMessages, tokenizer: Any, calls: list[CallRef],
                  window: int) -> list[np.ndarray]:
    """The last `window` tokens of each call's rendered prompt (see iter_prompt_tokens)."""
    return list(iter_prompt_tokens(store, tokenizer, calls, window))


def iter_prompt_tokens(store: Store | PromptMessages, tokenizer: Any, calls: list[CallRef], window: int,
                       chunk: int = 256) -> Iterator[np.ndarray]:
    """The last `window` tokens of each call's rendered prompt, in order, `chunk` calls at a time.

    With a ChatML-style tokenizer each distinct message is tokenized once (agents resend their
    whole history on every call), checked first against rendering whole prompts on a sample of the
    calls; any difference, or another template, renders and tokenizes each prompt's tail instead.
    """
    prefix = chatml_blocks(tokenizer)
    cache: dict[int, list[int]] = {}
    fast = prefix is not None and bool(calls)
    if fast:
        sample = [calls[i] for i in range(0, len(calls), max(1, len(calls) // 16))]
        slow = _prompt_tokens_rendered(store, tokenizer, sample, window)
        fast = all(np.array_equal(f, s) for f, s in
                   zip(_prompt_tokens_by_message(store, tokenizer, sample, window, prefix, cache), slow))
    lo, size = 0, min(8, chunk)  # the first calls' prompts soon, then larger batches
    while lo < len(calls):
        part = calls[lo : lo + size]
        yield from (_prompt_tokens_by_message(store, tokenizer, part, window, prefix, cache) if fast
                    else _prompt_tokens_rendered(store, tokenizer, part, window))
        lo, size = lo + size, min(2 * size, chunk)


def _prompt_tokens_by_message(store: Store | PromptMessages, tokenizer: Any, calls: list[CallRef], window: int,
                              prefix: str, cache: dict[int, list[int]]) -> list[np.ndarray]:
    backend = tokenizer.backend_tokenizer
    prefix_ids = backend.encode(prefix, add_special_tokens=False).ids if prefix else []
    out = []
    for call in calls:
        ids = store.call_prompt_ids(call.id) or []
        first = store.message(ids[0]) if ids else None
        if first is not None and len(ids) == 1 and first.get("role") == "prompt_text":
            _encode_messages(store, backend, cache, ids)
            tokens = cache[ids[0]]
        else:
            tokens, full, pos = [], False, len(ids)
            while pos and not full:  # from the end, until the window is full: earlier messages never tokenized
                chunk = ids[max(0, pos - 8) : pos]
                _encode_messages(store, backend, cache, chunk)
                for mid in reversed(chunk):
                    tokens[:0] = cache[mid]
                    pos -= 1
                    if len(tokens) >= window:
                        full = True
                        break
            if not full and ids and first.get("role") != "system":
                tokens[:0] = prefix_ids
        out.append(np.asarray(tokens[-window:] if window else [], dtype=np.int32))
    return out


def _encode_messages(store: Store | PromptMessages, backend: Any, cache: dict[int, list[int]], ids: list[int]) -> None:
    """Tokenize the messages of `ids` not in `cache` yet (one batch): a ChatML block each, or a plain text prompt."""
    missing = [mid for mid in dict.fromkeys(ids) if mid not in cache]
    if not missing:
        return
    messages = [store.message(mid) for mid in missing]
    texts = [m["content"] if m.get("role") == "prompt_text" else chatml_block(m) for m in messages]
    for mid, enc in zip(missing, backend.encode_batch(texts, add_special_tokens=False)):
        cache[mid] = enc.ids


def _prompt_tokens_rendered(store: Store | PromptMessages, tokenizer: Any, calls: list[CallRef], window: int) -> list[np.ndarray]:
    """Render each prompt's last messages (CHARS_PER_TOKEN characters per wanted token) and
    tokenize; one that comes out shorter than the window with messages left out is redone in full."""
    render = lambda messages: render_prompt(tokenizer, messages)  # noqa: E731
    backend = tokenizer.backend_tokenizer
    texts = prompt_texts(store, calls, render, max_chars=window * CHARS_PER_TOKEN)
    out: list[np.ndarray] = []
    for i in range(0, len(texts), 256):
        batch = texts[i : i + 256]
        encoded = backend.encode_batch([t for t, _ in batch], add_special_tokens=False)
        for j, (enc, (_, cut)) in enumerate(zip(encoded, batch)):
            ids = enc.ids
            if cut and len(ids) < window:
                full = prompt_texts(store, [calls[i + j]], render, max_chars=None)[0][0]
                ids = backend.encode(full, add_special_tokens=False).ids
            out.append(np.asarray(ids[-window:] if window else [], dtype=np.int32))
    return out


def model_prompts(store: Store, tokenizer: Any, calls: list[CallRef], window: int) -> tuple[list[CallRef], list[list[int]]]:
    """The calls that have a prompt, and each prompt as the model reads it: chat template with the
    assistant's turn opened (plain-text prompts as they are), cut to the last `window` tokens."""
    kept, prompts = [], []
    for call in calls:
        messages = store.call_prompt(call.id)
        if not messages:
            continue
        ids = tokenizer.encode(render_prompt(tokenizer, messages, generation_prompt=True), add_special_tokens=False)
        kept.append(call)
        prompts.append(list(ids[-window:]))
    return kept, prompts
