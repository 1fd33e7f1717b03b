"""vLLM 0.32's suffix proposer, replicated without vLLM: the tests and examples/proposer_bench.py
drive a drafter exactly as the engine does."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Batch:
    """The fields of vLLM's InputBatch that the suffix proposer reads."""

    prompts: dict[str, list[int]]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # req_ids in batch order

    @property
    def req_ids(self):
        return self.order

    @property
    def req_id_to_index(self):
        return {r: i for i, r in enumerate(self.order)}

    def tokens(self, i):
        r = self.order[i]
        return self.prompts[r] + self.outputs.get(r, [])


def propose(cache, batch, sampled, num_speculative_tokens=8, max_model_len=4096, max_tree_depth=24):
    """vllm/v1/spec_decode/suffix_decoding.py (0.32.0) SuffixDecodingProposer.propose, on Batch."""
    drafts = []
    for i, sampled_ids in enumerate(sampled):
        if not sampled_ids:
            drafts.append([])
            continue
        req_id = batch.req_ids[i]
        tokens = batch.tokens(i)
        num_tokens = len(tokens)
        if num_tokens >= max_model_len:
            drafts.append([])
            continue
        if req_id not in cache.active_requests:
            if req_id in cache.cached_requests:
                cache.evict_cached_response(req_id)
            cache.start_request(req_id, np.array(batch.prompts[req_id], dtype=np.int32))
        cache.add_active_response(req_id, sampled_ids)
        start = max(0, num_tokens - max_tree_depth)
        pattern = np.array(tokens[start:num_tokens], dtype=np.int32)
        draft = cache.speculate(req_id, pattern, max_spec_tokens=min(num_speculative_tokens,
                                                                      max_model_len - num_tokens - 1),
                                max_spec_factor=1.0, min_token_prob=0.1)
        drafts.append(draft.token_ids)
    for req_id in cache.active_requests - batch.req_id_to_index.keys():
        cache.stop_request(req_id)
    return drafts


def step(cache, batch, new_tokens, **kw):
    """One engine step: each scheduled request gets its sampled tokens, then the proposer runs."""
    sampled = []
    for r in batch.order:
        toks = new_tokens.get(r, [])
        batch.outputs.setdefault(r, []).extend(toks)
        sampled.append(list(toks))
    return propose(cache, batch, sampled, **kw)
