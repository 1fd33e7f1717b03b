"""specx as vLLM's suffix drafter, without vLLM: the drafter driven exactly as vLLM 0.32's
`SuffixDecodingProposer.propose` drives it (replicated in vllm_proposer.py). The plugin over a real store: test_vllm_plugin.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brute
from vllm_proposer import Batch, step
from specx.core.draft import Draft
from specx.core.index.suffix_cache import SuffixCache
from specx.core.index.suffix_index import SuffixIndex
from specx.core.index.tokens import SuffixIndexError


# --------------------------------------------------------------------------- helpers

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def finished_log():
    seen = []
    return seen, lambda req_id, prompt, output: seen.append((req_id, prompt.tolist(), output.tolist()))


# --------------------------------------------------------------------------- the cache, as vLLM drives it

def test_lifecycle_drafts_learns_and_finishes_once_after_the_lazy_stop():
    clock = Clock()
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex.build([[1, 2, 3, 9, 10, 11, 12, 13]]), on_finish=on_finish, linger_s=2.0,
                        clock=clock)
    batch = Batch({"a": [1, 2, 3]}, order=["a"])
    # [1, 2, 3, 9] matches 4 tokens of the global index: a path of up to 4 (max_spec_factor 1)
    assert step(cache, batch, {"a": [9]}) == [[10, 11, 12, 13]]
    assert step(cache, batch, {"a": [10, 11]}) == [[12, 13]]
    batch.order = []  # "a" finished: vLLM drops it from the batch and stops it at the next propose
    step(cache, batch, {})
    assert "a" in cache.cached_requests and not seen  # stopped, may still come back
    clock.now = 5.0
    batch.prompts["b"] = [7]
    batch.order = ["b"]
    step(cache, batch, {"b": [8]})
    assert seen == [("a", [1, 2, 3], [9, 10, 11])]  # once, first and last token included
    assert cache.global_index.count([9, 10, 11]) == 2  # the finished output (no prompt), sealed beside the old


def test_outputs_are_live_in_the_global_index_for_other_requests():
    cache = SuffixCache(SuffixIndex(64))
    batch = Batch({"a": [1], "b": [2]}, order=["a", "b"])
    step(cache, batch, {"a": [5, 6, 7, 8], "b": [3]})
    drafts = step(cache, batch, {"a": [4], "b": [5]})  # b now ends with 5: a's live output goes on with 6
    assert drafts[1] == [6]


def test_a_preempted_request_resumes_with_its_output_and_is_stored_once():
    clock = Clock()
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex(64), on_finish=on_finish, linger_s=2.0, clock=clock)
    batch = Batch({"a": [1, 2], "b": [3]}, order=["a", "b"])
    step(cache, batch, {"a": [4, 5], "b": [6]})
    batch.order = ["b"]  # "a" preempted (or not scheduled): stopped lazily
    step(cache, batch, {"b": [7]})
    assert "a" in cache.cached_requests
    clock.now = 1.0
    batch.order = ["b", "a"]  # back with the same id: vLLM evicts the cached response and starts again
    step(cache, batch, {"b": [8], "a": [9]})
    assert "a" in cache.active_requests
    assert cache.speculate("a", [4, 5], max_spec_tokens=4).token_ids == [9]  # its own output so far is indexed
    assert cache.flush() == 2
    assert sorted(seen) == [("a", [1, 2], [4, 5, 9]), ("b", [3], [6, 7, 8])]


def test_a_request_left_out_of_many_slow_steps_is_stored_once_when_the_engine_says_it_finished():
    clock = Clock()
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex(64), on_finish=on_finish, linger_s=600.0, clock=clock)
    batch = Batch({"a": [1, 2], "b": [3]}, order=["a", "b"])
    step(cache, batch, {"a": [4], "b": [6]})
    batch.order = ["b"]
    for t in range(1, 6):  # "a" waits behind "b" for 50 s of slow steps (a CPU behind long prefills)
        clock.now = 10.0 * t
        step(cache, batch, {"b": [7]})
        assert cache.finish_idle(10.0) == 0 and "a" in cache.cached_requests
    batch.order = ["a", "b"]
    step(cache, batch, {"a": [5], "b": [8]})
    assert seen == []
    assert cache.engine_step(finished=["a", "never-seen"]) == 1  # over before vLLM's lazy stop: finished now
    assert seen == [("a", [1, 2], [4, 5])] and "a" not in cache.active_requests
    batch.order = ["b"]
    step(cache, batch, {"b": [9]})  # the stop never comes for "a": it is no longer active
    assert cache.engine_step(finished={"never-seen": [1]}) == 0
    clock.now = 100.0  # the next step began at 95 s and takes longer than the idle timeout: not idleness
    cache.engine_step()
    clock.now = 130.0
    assert cache.finish_idle(10.0) == 0 and "b" in cache.active_requests
    # the engine's whole output: the tokens of steps where vLLM skipped the drafter are appended
    assert cache.engine_step(finished={"b": [6, 7, 7, 7, 7, 7, 8, 9, 10, 11]}) == 1
    assert seen[1] == ("b", [3], [6, 7, 7, 7, 7, 7, 8, 9, 10, 11]) and not cache.active_requests
    assert not cache.cached_requests and cache.global_index.count([9, 10, 11]) == 1
    step(cache, Batch({"c": [3]}, order=["c"]), {"c": [20, 22]})  # 21 came in a step vLLM did not draft in
    assert cache.engine_step(finished={"c": [20, 21, 22]}) == 1
    assert seen[2] == ("c", [3], [20, 21, 22]) and cache.global_index.count([20, 21, 22]) == 1
    assert cache.global_index.count([20, 22]) == 0  # the gapped copy is gone from the global index


def test_quiet_requests_finish_without_another_engine_step():
    clock = Clock()
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex(64), on_finish=on_finish, linger_s=2.0, clock=clock)
    batch = Batch({"a": [1], "b": [2]}, order=["a", "b"])
    step(cache, batch, {"a": [3], "b": [4]})
    batch.order = ["b"]
    step(cache, batch, {"b": [5]})  # a stopped; b is the engine's last request: never stopped
    clock.now = 1.0
    assert cache.finish_idle(10.0) == 0
    clock.now = 3.0
    assert cache.finish_idle(10.0) == 1 and seen == [("a", [1], [3])]  # lingered long enough
    clock.now = 10.0
    assert cache.finish_idle(10.0) == 1 and seen[1] == ("b", [2], [4, 5])
    assert not cache.active_requests
    step(cache, batch, {"b": [6]})  # b was only waiting: it starts again, from its prompt
    assert "b" in cache.active_requests


def test_a_new_request_reusing_an_id_with_another_prompt_finishes_the_old_one():
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex(64), on_finish=on_finish, linger_s=100.0)
    cache.start_request("x", [1, 2])
    cache.add_active_response("x", [3])
    cache.stop_request("x")
    cache.evict_cached_response("x")
    cache.start_request("x", [7, 7])
    assert seen == [("x", [1, 2], [3])]
    with pytest.raises(SuffixIndexError):
        cache.start_request("x", [7, 7])  # already active


def test_drafts_never_longer_than_the_engine_allows():
    long = list(range(100, 160))
    for k in (1, 3, 8):
        cache = SuffixCache(SuffixIndex.build([long]), max_tree_depth=64)
        batch = Batch({"a": long[:20]}, order=["a"])
        drafts = step(cache, batch, {"a": long[20:21]}, num_speculative_tokens=k, max_tree_depth=64)
        assert 0 < len(drafts[0]) <= k
    cache = SuffixCache(SuffixIndex.build([long]), max_tree_depth=64)
    batch = Batch({"a": long[:20]}, order=["a"])
    drafts = step(cache, batch, {"a": long[20:21]}, num_speculative_tokens=16, max_model_len=24, max_tree_depth=64)
    assert len(drafts[0]) <= 24 - 21 - 1
    assert cache.speculate("a", long[:21], max_spec_tokens=0).token_ids == []


def test_the_linear_draft_is_the_best_path_of_both_indexes():
    # The prompt matches 4 tokens and goes on 8, 9, 1, 2 (each D = 1/2: the match at the end has no
    # next token), expected 2.0; the global index matches 2 and goes on 7 (D = 1), expected 1.0.
    prompt = [1, 2, 3, 4, 8, 9, 1, 2, 3, 4]
    cache = SuffixCache(SuffixIndex.build([[3, 4, 7]]))
    cache.start_request("a", prompt)
    d = cache.speculate("a", prompt, max_spec_tokens=8)
    assert d.parents == [-1, 0, 1, 2] and d.token_ids == [8, 9, 1, 2]
    assert cache.speculate("a", prompt, max_spec_tokens=8, use_tree_spec=True).token_ids[:5] == [8, 9, 1, 2, 7]


def test_best_path_by_hand():
    # Two branches: [3, 4] scores 0.6 + 0.1, [5, 6] scores 0.4 + 0.4: the second.
    assert brute.best_path([-1, 0, -1, 2], [0.6, 0.1, 0.4, 0.4]) == [2, 3]
    assert brute.best_path([], []) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.floats(0.01, 1.0)), max_size=6),
       st.lists(st.tuples(st.integers(1, 3), st.floats(0.01, 1.0)), max_size=6))
def test_better_path_is_the_best_path_of_the_union(a, b):
    def path(items):
        return Draft([t for t, _ in items], list(range(-1, len(items) - 1)), [p for _, p in items],
                     sum(p for _, p in items), len(items))
    fast, union = path(a).better_path(path(b)), path(a).merge(path(b), 64)
    best = sum(union.probs[i] for i in brute.best_path(union.parents, union.probs))
    # fast's tokens walk down the union (a token names at most one child of a node), its probs are
    # the union's along that walk, and no path scores more (two paths may tie: either is right)
    nodes, parent = [], -1
    for t in fast.token_ids:
        nodes.append(next(i for i in range(len(union)) if union.parents[i] == parent and union.token_ids[i] == t))
        parent = nodes[-1]
    assert fast.parents == list(range(-1, len(nodes) - 1))
    assert fast.probs == pytest.approx([union.probs[i] for i in nodes])
    assert fast.score == pytest.approx(sum(fast.probs)) and fast.score == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.booleans())
def test_the_fused_step_equals_both_indexes_drafted_apart(seed, use_global):
    # core.index.engine_step appends and drafts in one compiled call; here the same indexes, after the
    # call, drafted one by one and merged by Draft.better_path. Requests interleave, their regions
    # fill and move (the kernel's no-room retry), and tokens come one to several per step.
    rng = np.random.default_rng(seed)
    history = [rng.integers(0, 6, rng.integers(1, 40)).tolist() for _ in range(rng.integers(0, 6))]
    cache = SuffixCache(SuffixIndex.build(history, vocab_size=8), max_tree_depth=24,
                        max_cached_requests=-1 if use_global else 0, linger_s=0.0)
    tokens = {}
    for step_no in range(60):
        rid = f"r{rng.integers(0, 2)}"
        if rid not in cache.active_requests:
            tokens[rid] = rng.integers(0, 6, rng.integers(1, 70)).tolist()
            cache.start_request(rid, tokens[rid])
        new = rng.integers(0, 6, rng.integers(1, 9)).tolist()
        tokens[rid] += new
        cache.add_active_response(rid, new)
        ctx = np.array(tokens[rid][-24:], dtype=np.int32)
        k = int(rng.integers(0, 9))
        got = cache.speculate(rid, ctx, max_spec_tokens=k)
        req = cache._active[rid]
        mine = req.index.speculate(ctx, k, 1.0, 0.1, tree=False) or Draft()
        other = (cache.global_index.speculate(ctx, k, 1.0, 0.1, tree=False) or Draft()) if use_global else Draft()
        want = mine.better_path(other)
        assert (got.token_ids, got.parents, got.match_len) == (want.token_ids, want.parents, want.match_len)
        assert got.probs == want.probs and got.score == want.score
        assert req.output.tolist() == tokens[rid][len(tokens[rid]) - len(req.output):]
        if rng.random() < 0.1:
            cache.stop_request(rid)
    cache.flush()


def test_bad_tokens_are_refused_and_nothing_is_appended():
    cache = SuffixCache(SuffixIndex(64, vocab_size=10))
    cache.start_request("a", [1, 2, 3])
    cache.add_active_response("a", [4])
    with pytest.raises(SuffixIndexError, match="context"):
        cache.speculate("a", np.array([1, 2, 30], dtype=np.int32))
    with pytest.raises(SuffixIndexError, match="12"):
        cache.add_active_response("a", [12])
    with pytest.raises(SuffixIndexError, match="-1"):
        cache.add_active_response("a", np.array([-1], dtype=np.int32))
    assert cache.speculate("a", np.array([2, 3, 4], dtype=np.int32)).token_ids == []
    assert cache._active["a"].output.tolist() == [4]

def test_no_global_index_when_the_engine_caches_no_requests():
    seen, on_finish = finished_log()
    cache = SuffixCache(SuffixIndex.build([[1, 2, 3]]), max_cached_requests=0, on_finish=on_finish)
    cache.start_request("a", [9, 1])
    assert cache.speculate("a", [9, 1], max_spec_tokens=4).token_ids == []
    cache.add_active_response("a", [2])
    cache.flush()
    assert cache.global_index.num_sequences == 1
