"""A seeded synthetic corpus that looks like agent output: templated JSON-like records.

Each document is a run of records. A record picks one of `num_templates` templates (Zipf-
weighted, as agents favour a few tool calls); a template is a fixed skeleton of key and
punctuation tokens with value slots between them. A slot is filled with 1-6 tokens, drawn from a
small per-slot pool of recurring values (ids, paths, enum values: half the time) or from the whole
vocabulary with a Zipf law (free text). Token ids 0..255 are the "syntax" tokens; the rest of the
32k vocabulary carries values. The mix gives long exact repeats (skeletons) broken by
unpredictable values, which is what makes agent output speculable.
"""

from __future__ import annotations

import numpy as np


def synthetic_corpus(num_tokens: int = 1_000_000, vocab_size: int = 32_000, seed: int = 0,
                     num_templates: int = 64, doc_tokens: int = 600) -> list[np.ndarray]:
    """Documents (int32 arrays) totalling about `num_tokens` tokens."""
    rng = np.random.default_rng(seed)
    syntax = np.arange(256)
    templates = []
    for _ in range(num_templates):
        num_slots = int(rng.integers(2, 9))
        parts = [rng.choice(syntax, size=int(rng.integers(2, 7))) for _ in range(num_slots + 1)]
        pools = [rng.integers(256, vocab_size, size=(int(rng.integers(2, 12)), 4)) for _ in range(num_slots)]
        templates.append((parts, pools))
    template_p = 1.0 / np.arange(1, num_templates + 1) ** 1.1
    template_p /= template_p.sum()
    ranks = np.arange(1, vocab_size - 256 + 1, dtype=np.float64)
    value_p = 1.0 / ranks ** 1.05
    value_p /= value_p.sum()
    # Draw the random choices in bulk (per-record calls into the generator are the slow part).
    # A record has at least 8 tokens (2 slots of 2 syntax tokens and a value, 2 closing), and
    # the corpus overshoots num_tokens by less than a document: this many records always suffice.
    num_records = (num_tokens + 2 * doc_tokens) // 8 + 64
    record_templates = rng.choice(num_templates, size=num_records, p=template_p)
    value_lengths = rng.integers(1, 7, size=(num_records, 8))
    use_pool = rng.random((num_records, 8)) < 0.5
    pool_picks = rng.integers(0, 1 << 30, size=(num_records, 8))
    free_values = (256 + rng.choice(len(ranks), size=(num_records, 8, 6), p=value_p)).astype(np.int32)
    doc_sizes = rng.integers(doc_tokens // 2, doc_tokens * 3 // 2, size=num_tokens // (doc_tokens // 2) + 2)
    docs: list[np.ndarray] = []
    total = 0
    r = 0
    while total < num_tokens:
        out: list[np.ndarray] = []
        size = 0
        target = int(doc_sizes[len(docs)])
        while size < target:
            parts, pools = templates[int(record_templates[r])]
            for k, pool in enumerate(pools):
                n = int(value_lengths[r, k])
                if use_pool[r, k]:
                    value = pool[int(pool_picks[r, k]) % len(pool)][: min(n, 4)]
                else:
                    value = free_values[r, k, :n]
                out.append(parts[k])
                out.append(value)
                size += len(parts[k]) + len(value)
            out.append(parts[-1])
            size += len(parts[-1])
            r += 1
        doc = np.concatenate(out).astype(np.int32)
        docs.append(doc)
        total += len(doc)
    return docs
