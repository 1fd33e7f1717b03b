"""core.model.prefix_cache and the transformers engine's kind of it (core.model.transformers.prefix_cache):
prompts that share a prefix with an earlier one prefill only the rest, their KV entries equal a whole
prefill's, decoding through it (specx and transformers' own generate, prompt lookup included) equals
plain greedy decoding, the token budget holds, and the generic part imports neither torch nor
transformers."""

import random

import pytest
import torch

from specx.core.decode.generate import generate, greedy_decode
from specx.core.decode.request import Decoding
from specx.core.model.transformers.engine import TransformersEngine, hf_generate
from specx.core.model.transformers.kv_cache import cache_kwarg, new_cache
from specx.core.model.prefix_cache import PrefixCache
from specx.core.model.transformers.prefix_cache import TransformersPrefixCache

from helpers.decoding import FakeDrafter, MAKERS
from helpers.models import VOCAB, tiny_model

SHARED = [5, 9, 17, 33, 2, 71, 40, 8, 61, 23, 19, 88, 3, 54]  # a system prompt every request starts with


def agent_prompts(rng: random.Random, num: int) -> list[list[int]]:
    """Requests as an agent sends them: a common head, then either a new question or the previous
    request extended by a new turn."""
    prompts = [SHARED + [rng.randrange(VOCAB) for _ in range(6)]]
    for _ in range(num - 1):
        base = prompts[-1] if rng.random() < 0.5 else SHARED
        prompts.append(base + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))])
    return prompts


def kv(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_reused_entries_equal_a_whole_prefill():
    model = tiny_model(torch.float64)
    prefixes = TransformersPrefixCache()
    first = SHARED + [1, 2, 3]
    second = SHARED + [4, 5, 6, 7]
    prefixes.prefill(model, first)
    cache = prefixes.prefill(model, second)
    assert (prefixes.hit_tokens, prefixes.miss_tokens) == (len(SHARED), len(first) + 4)
    whole = TransformersPrefixCache(0).prefill(model, second)
    assert cache.get_seq_length() == len(second)
    for (k, v), (k0, v0) in zip(kv(cache), kv(whole), strict=True):
        torch.testing.assert_close(k, k0, rtol=0, atol=1e-12)
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-12)


def test_a_copy_is_handed_out_and_the_stored_entries_stay_intact():
    model = tiny_model(torch.float64)
    prefixes = TransformersPrefixCache()
    prompt = SHARED + [1, 2, 3]
    prefixes.prefill(model, prompt)
    stored = [(k.clone(), v.clone()) for k, v in prefixes._entries[0][1]]
    cache = prefixes.prefill(model, prompt)  # all of it reused: nothing to run
    assert prefixes.miss_tokens == len(prompt)
    model(input_ids=torch.tensor([[7, 7, 7]]), **{cache_kwarg(model): cache}, use_cache=True)  # decoding appends
    cache.crop(-(cache.get_seq_length() - len(SHARED)))
    model(input_ids=torch.tensor([[9] * 6]), **{cache_kwarg(model): cache}, use_cache=True)  # and overwrites after a crop
    for (k, v), (k0, v0) in zip(prefixes._entries[0][1], stored, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_speculative_greedy_through_the_prefix_cache_equals_plain(make):
    model = tiny_model(torch.float64)
    rng = random.Random(make.__name__)
    prefixes = TransformersPrefixCache()
    for i, prompt in enumerate(agent_prompts(rng, 6)):
        ref = greedy_decode(model, prompt, 16)
        steps = generate(TransformersEngine(model), prompt, FakeDrafter(make, ref, seed=i), Decoding(max_new_tokens=16),
                         prefix_cache=prefixes)
        assert [t for s in steps for t in s.new_tokens] == ref
    assert prefixes.hit_tokens >= 5 * len(SHARED)


def test_transformers_generate_and_prompt_lookup_through_the_prefix_cache():
    # transformers' assisted decoding runs its first pass over the whole input; with a filled cache
    # that would feed the prompt twice (hf_generate runs it over the uncached tokens)
    model = tiny_model(torch.float64)
    rng = random.Random(3)
    plain, lookup = TransformersPrefixCache(), TransformersPrefixCache()
    for prompt in agent_prompts(rng, 5):
        prompt = prompt + prompt[-6:]  # a repeat for prompt lookup to find
        ref = greedy_decode(model, prompt, 20)
        assert hf_generate(model, prompt, 20, None, prefix_cache=plain) == ref
        assert hf_generate(model, prompt, 20, None, prompt_lookup_num_tokens=4, prefix_cache=lookup) == ref
        assert "prepare_inputs_for_generation" not in model.__dict__  # the override is gone afterwards
    assert plain.hit_tokens == lookup.hit_tokens >= 4 * len(SHARED)


def test_budget_least_recently_used_first_out_and_extensions_replace():
    model = tiny_model(torch.float64)
    prefixes = TransformersPrefixCache(max_tokens=50)
    a, b = SHARED + [1] * 6, [2] * 20
    prefixes.prefill(model, a)
    prefixes.prefill(model, b)
    prefixes.prefill(model, a + [3, 3])  # an agent's next turn: it replaces the entry it extends
    assert [len(t) for t, _ in prefixes._entries.values()] == [20, 22]
    prefixes.prefill(model, [4] * 10)  # over the budget: b, of no known pace, least recently used, goes
    assert [len(t) for t, _ in prefixes._entries.values()] == [22, 10]
    assert prefixes.num_tokens == 32 and prefixes.evicted_tokens == 20
    prefixes.prefill(model, [5] * 51)  # longer than the whole budget: prefilled, not stored
    assert sorted(len(t) for t, _ in prefixes._entries.values()) == [10, 22]
    assert prefixes.num_tokens == sum(len(t) for t, _ in prefixes._entries.values())


def cycle(prefixes: PrefixCache, agents: int, turns: int, start: int = 100, step: int = 10) -> list[int]:
    """Agents taking turns in a cycle, each turn its conversation grown by `step` tokens: the tokens
    each turn reused."""
    talks = [[1000 * (a + 1) + i for i in range(start)] for a in range(agents)]
    reused = []
    for _ in range(turns):
        for a, talk in enumerate(talks):
            talk.extend(range(1000 * (a + 1) + len(talk), 1000 * (a + 1) + len(talk) + step))
            reused.append(len(talk) - prefixes.plan(talk))
    return reused


def test_agents_in_a_cycle_that_outgrow_the_budget_keep_reusing_what_fits():
    """Four agents in turn, a budget for about two and a half conversations: least recently used
    would push out the next to come at every turn (nothing reused); the entry expected back last
    goes instead, so the turns after the first cycles reuse as many conversations as fit."""
    reused = cycle(PrefixCache(max_tokens=300), agents=4, turns=8)
    assert reused[:4] == [0, 0, 0, 0]  # first turns: nothing stored yet
    per_cycle = [sum(1 for r in reused[c * 4:c * 4 + 4] if r) for c in range(8)]
    assert per_cycle[2:6] == [2, 2, 2, 2]  # two conversations of up to 150 tokens fit 300: two reused
    assert per_cycle[6:] == [1, 1]  # then one
    assert all(r in (0, 100 + 10 * (i // 4)) for i, r in enumerate(reused))  # reused whole, or not at all

    class LeastRecentlyUsed(PrefixCache):  # the order before: the same cycle reuses nothing
        def next_use(self, key: int) -> int:
            return -self._turns[key].at
    assert sum(cycle(LeastRecentlyUsed(max_tokens=300), agents=4, turns=8)) == 0
    assert sum(cycle(PrefixCache(max_tokens=1000), agents=4, turns=8)[4:]) == sum(  # all fit: all reused
        100 + 10 * t for t in range(1, 8) for _ in range(4))


def test_a_conversation_that_stops_coming_goes_out_before_the_live_ones():
    prefixes = PrefixCache(max_tokens=400)
    cycle(prefixes, agents=2, turns=3)  # two conversations of 130 tokens, each back every 2 claims
    gone = next(k for k, (t, _) in prefixes._entries.items() if t[0] == 1000)  # agent 0's: it stops
    live = [2000 + i for i in range(130)]
    for i in range(4):  # agent 1 goes on alone, growing; a new request now and then
        live.extend(range(2000 + len(live), 2000 + len(live) + 10))
        assert prefixes.plan(live) == 10
    assert prefixes.next_use(gone) > max(prefixes.next_use(k) for k in prefixes._entries if k != gone)
    prefixes.plan([9] * 150)  # a new agent's first turn: the budget needs agent 0's tokens
    assert gone not in prefixes._entries and any(t[0] == 2000 for t, _ in prefixes._entries.values())


def test_kv_memory_is_sized_from_the_models_bytes_per_token():
    from specx.stack import kv_budget_tokens
    from specx.core.model.prefix_cache import kv_bytes_per_token, parse_bytes

    engine = TransformersEngine(tiny_model(torch.float64))
    cfg = engine.model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 8
    assert kv_bytes_per_token(engine) == per_token
    said = []
    assert kv_budget_tokens(engine, 100 * per_token + 5, said.append) == 100 and "100 tokens" in said[0]
    assert [parse_bytes(t) for t in ("512", "2K", "1.5M", "2G", "3GiB", "1gb")] == [
        512, 2048, 3 << 19, 2 << 30, 3 << 30, 1 << 30]
    for bad in ("", "2X", "-1G", "G"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)


def test_zero_budget_and_other_caches():
    model = tiny_model(torch.float64)
    off = TransformersPrefixCache(0)
    off.prefill(model, SHARED)
    cache = off.prefill(model, SHARED)
    assert off.hit_tokens == 0 and off.num_tokens == 0 and cache.get_seq_length() == len(SHARED)
    assert type(cache) is type(new_cache(model))
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixCache(-1)
    assert type(TransformersEngine(model).new_prefix_cache(10)) is TransformersPrefixCache


def test_compare_times_the_prefill_apart():
    from specx.core.predict.compare import compare, summary

    engine = TransformersEngine(tiny_model(torch.float64))
    prompts = agent_prompts(random.Random(5), 3)
    from specx.core.decode.speculate import SuffixDrafter

    drafter = SuffixDrafter()
    runs = compare(engine, prompts, drafter, max_new_tokens=12, eos_token_id=None, methods=["plain", "specx"],
                   prefix_cache_tokens=4096)
    for run in runs.values():
        assert 0 < run.prefill_seconds < run.seconds
    rows = summary(runs).methods
    specx, plain = rows["specx"], rows["plain"]
    want = (specx.tokens / (specx.seconds - specx.prefill_seconds)) / (
        plain.tokens / (plain.seconds - plain.prefill_seconds))
    assert specx.decode_speedup_vs["plain"] == pytest.approx(want)
    assert "plain" not in summary(compare(engine, prompts[:1], drafter, max_new_tokens=4, eos_token_id=None,
                                          methods=["plain", "specx"])).methods["specx"].decode_speedup_vs


def test_plan_counts_what_prefill_prefills():
    model = tiny_model(torch.float64)
    prompts = agent_prompts(random.Random(7), 6)
    real, counted = TransformersPrefixCache(max_tokens=60), PrefixCache(max_tokens=60)  # small: entries are evicted too
    for prompt in prompts:
        before = real.miss_tokens
        real.prefill(model, prompt)
        assert counted.plan(prompt) == real.miss_tokens - before
    assert (counted.hit_tokens, counted.miss_tokens) == (real.hit_tokens, real.miss_tokens) and real.hit_tokens > 0
    assert [t.tolist() for t, _ in counted._entries.values()] == [t.tolist() for t, _ in real._entries.values()]


def test_the_generic_prefix_cache_imports_no_engine():
    """core.model.prefix_cache is every engine's: importing it loads neither torch nor transformers
    (each engine's kind, in its wing, brings its own)."""
    import subprocess
    import sys

    code = ("import sys, specx.core.model.prefix_cache\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
