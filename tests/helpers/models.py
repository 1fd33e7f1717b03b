"""A tiny random Llama (transformers) and random draft trees over its vocabulary: the tests'
models for the transformers engine, the decode loop and the kernels."""

import random

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specx.core.draft import Draft
from specx.core.model.transformers.kv_cache import cache_kwarg

VOCAB = 97


def tiny_model(dtype: torch.dtype = torch.float64, attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    # initializer_range well above the default 0.02: peaked next-token distributions, so greedy
    # continuations vary and argmax near-ties (which float noise could flip) are rare
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)


def random_tree(rng: random.Random, num_nodes: int, vocab: int = VOCAB) -> Draft:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, num_nodes)]
    return Draft([rng.randrange(vocab) for _ in range(num_nodes)], parents, [0.5] * num_nodes, 0.5 * num_nodes, 1)


def prefilled(model, tokens):
    cache = DynamicCache(config=model.config)
    if tokens:
        model(input_ids=torch.tensor([tokens]), **{cache_kwarg(model): cache}, use_cache=True)
    return cache
