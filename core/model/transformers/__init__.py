"""transformers as an engine: a Hugging Face model verified in trees, on specx's small-batch kernels.

    engine.py        the Engine protocol (TransformersEngine, TransformersSession) and transformers'
                     own greedy decoding, the baseline (hf_generate)
    tree.py          the tree pass: mask, position ids, logits, the cache pruned to the accepted path
    kv_cache.py      the KV cache (GrowingCache: appends in place) and the keyword a model takes it by
    kernels.py       accelerate(): a model switched in place to the kernels below
    matmul.py        the small-batch linear layer (a packed copy of each weight, batch-invariant)
    attention.py     grouped-query attention with a mask, without repeating the key/value heads
    prefix_cache.py  TransformersPrefixCache: core.model.prefix_cache.PrefixCache, storing copies of
                     transformers' cache layers

Inside this package `import transformers` is Hugging Face's package (imports are absolute); the
package's own modules import each other relatively.
"""
