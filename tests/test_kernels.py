"""core.model.transformers.kernels (and the wing's matmul, attention, kv_cache): the small-batch linear
kernel is exact and batch-invariant, the grouped-query attention and the growing cache change nothing
but speed, and an accelerated model still decodes speculatively token for token like plain greedy
(transformers' own prompt lookup too)."""

import random

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from specx.core.decode.generate import generate, greedy_decode
from specx.core.decode.request import Decoding
from specx.core.model.transformers import attention, kernels, kv_cache, matmul
from specx.core.model.transformers.engine import TransformersEngine
from specx.core.model.transformers.tree import keep_accepted, tree_logits

from helpers.decoding import FakeDrafter, MAKERS, collect
from helpers.models import VOCAB, prefilled, random_tree, tiny_model


@pytest.mark.parametrize("rows,n,k", [(1, 64, 32), (5, 37, 19), (16, 96, 576), (3, 3, 7), (24, 200, 1536)])
def test_panel_matmul_is_a_matmul(rows, n, k):
    rng = np.random.default_rng(rows * n)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = matmul.linear_rows(x, matmul.pack_weight(w), n)
    assert out.shape == (rows, n)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_panel_matmul_is_batch_invariant():
    # a row's result is the same bits alone, among others, and at any position in the batch
    rng = np.random.default_rng(7)
    w = matmul.pack_weight(rng.standard_normal((70, 150), dtype=np.float32))  # 70: padded to 96
    x = rng.standard_normal((matmul.MAX_ROWS, 150), dtype=np.float32)
    full = matmul.linear_rows(x, w, 70)
    for m in range(matmul.MAX_ROWS):  # every kernel (4, 8, ... 24 rows) in turn
        assert np.array_equal(matmul.linear_rows(x[m : m + 1], w, 70)[0], full[m])  # alone (padded)
        assert np.array_equal(matmul.linear_rows(x[m:], w, 70)[0], full[m])  # first of the rest
    assert np.array_equal(matmul.linear_rows(x[::-1].copy(), w, 70)[::-1], full)  # other partners
    assert np.array_equal(matmul.linear_rows(x[1:], w, 70), full[1:])  # every row in the other slot


def test_small_batch_linear_uses_the_kernel_only_where_it_applies():
    torch.manual_seed(0)
    stock = torch.nn.Linear(40, 24)
    fast = torch.nn.Linear(40, 24)
    fast.load_state_dict(stock.state_dict())
    fast.__class__ = matmul.SmallBatchLinear
    with torch.no_grad():
        for shape in [(1, 40), (1, 3, 40), (2, 3, 40), (1, matmul.MAX_ROWS, 40)]:
            x = torch.randn(shape)
            torch.testing.assert_close(fast(x), stock(x), rtol=1e-5, atol=1e-5)
        # a decoding step's row has the bits it has among the rows of a verification pass
        x = torch.randn(5, 40)
        assert torch.equal(fast(x[:1]), fast(x)[:1]) and torch.equal(fast(x[2:5]), fast(x)[2:5])
        # a prefill: the stock path, bit for bit
        x = torch.randn(1, matmul.MAX_ROWS + 1, 40)
        assert torch.equal(fast(x), stock(x))
    x = torch.randn(matmul.MIN_ROWS, 40, requires_grad=True)  # training: the stock path keeps autograd working
    fast(x).sum().backward()
    assert x.grad is not None


def test_gqa_attention_equals_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    q, k, v = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    mask = torch.where(torch.rand(1, 1, 5, 11) < 0.3, torch.finfo(torch.float32).min, 0.0)
    mask[..., 0] = 0.0  # every query sees at least one key
    ours, _ = attention.gqa_attention(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert ours.shape == ref.shape == (1, 5, 6, 8)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_growing_cache_holds_what_the_dynamic_cache_holds():
    model = tiny_model(torch.float32)
    rng = random.Random(3)
    prefix = [rng.randrange(VOCAB) for _ in range(300)]  # past the first buffer: it has to grow
    grown, plain = kv_cache.GrowingCache(), DynamicCache(config=model.config)
    with torch.no_grad():
        for cache in (grown, plain):
            model(input_ids=torch.tensor([prefix]), **{kv_cache.cache_kwarg(model): cache}, use_cache=True)
        for _ in range(6):
            draft = random_tree(rng, rng.randrange(1, 9))
            pending = [rng.randrange(VOCAB)]
            num_kept = grown.get_seq_length() + 1
            accepted = sorted(rng.sample(range(len(draft)), rng.randrange(0, len(draft) + 1)))
            for cache in (grown, plain):
                tree_logits(model, cache, pending, draft, linear=None)
                keep_accepted(cache, num_kept, accepted, len(draft))
            for g, p in zip(grown.layers, plain.layers):
                assert torch.equal(g.keys, p.keys) and torch.equal(g.values, p.values)
    assert kv_cache.new_cache(model).__class__ is kv_cache.GrowingCache


@pytest.fixture(scope="module")
def fast32():
    model = tiny_model(torch.float32, seed=5)
    assert kernels.accelerate(model) == ["small-batch linear (15 layers)", "grouped-query attention"]
    return model


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_accelerated_speculative_greedy_equals_plain_greedy(fast32, make):
    rng = random.Random(11)
    for _ in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        ref = greedy_decode(fast32, prompt, 50)
        drafter = FakeDrafter(make, ref, seed=rng.randrange(100))
        out, _ = collect(generate(TransformersEngine(fast32), prompt, drafter, Decoding(max_new_tokens=20)))
        assert out == ref[:20]


def test_accelerated_model_under_transformers_generate(fast32):
    # transformers builds the masks for the registered attention as for sdpa: without that its
    # prompt lookup verified candidates against a cache cut to the candidates alone
    from specx.core.model.transformers.engine import hf_generate

    stock = tiny_model(torch.float32, seed=5)
    rng = random.Random(2)
    for _ in range(3):
        prompt = [rng.randrange(8) for _ in range(40)]  # a small alphabet: prompt lookup finds matches
        ref = hf_generate(stock, prompt, 24, None)
        assert hf_generate(fast32, prompt, 24, None) == ref
        assert hf_generate(fast32, prompt, 24, None, prompt_lookup_num_tokens=5) == ref


def test_accelerate_leaves_other_dtypes_on_the_stock_linear():
    model = tiny_model(torch.float64)
    assert kernels.accelerate(model) == ["grouped-query attention"]
    assert not any(isinstance(m, matmul.SmallBatchLinear) for m in model.modules())
    tree = random_tree(random.Random(0), 5)
    assert tree_logits(model, prefilled(model, [1, 2, 3]), [4], tree, linear=None).dtype == torch.float64
