"""Drafts: the compiled kernel against the brute-force reference, hand-worked examples, the drafter."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brute
from specx.core.decode.speculate import SuffixDrafter
from specx.core.draft import GLOBAL, REQUEST, Draft
from specx.core.index.suffix_index import SuffixIndex

tokens = st.lists(st.integers(0, 3), max_size=14)
params = st.fixed_dictionaries({
    "max_spec_tokens": st.sampled_from([0, 1, 3, 8, 32]),
    "max_spec_factor": st.sampled_from([0.5, 1.0, 2.0, 4.0]),
    "min_token_prob": st.sampled_from([0.0, 0.1, 0.3, 1.0]),
    "tree": st.booleans(),
})


def as_tuple(draft):
    return None if draft is None else (draft.token_ids, draft.parents, draft.probs, draft.score, draft.match_len)


def brute_draft(docs, context, max_depth, p, floor=(0.0, 0)):
    return brute.speculate(docs, context, max_depth, p["max_spec_tokens"], p["max_spec_factor"],
                           p["min_token_prob"], p["tree"], floor)


@given(st.lists(tokens, max_size=6), st.lists(tokens, max_size=2), st.lists(st.integers(0, 3), min_size=1, max_size=12),
       params, st.booleans())
@settings(max_examples=400, deadline=None)
def test_drafts_equal_brute_force(docs, live, context, p, bulk):
    index = SuffixIndex.build(docs, max_depth=8) if bulk else SuffixIndex(max_depth=8)
    if not bulk:
        for d in docs:
            index.add(d)
    for seq in live:
        index.start(seq)
    got = index.speculate(context, **p)
    assert as_tuple(got) == brute_draft(docs + live, context, 8, p)


@given(st.lists(tokens, max_size=5), st.lists(st.integers(0, 3), min_size=1, max_size=10), params,
       st.floats(0, 6), st.integers(0, 10))
@settings(max_examples=200, deadline=None)
def test_floor_is_respected(docs, context, p, floor_score, floor_len):
    index = SuffixIndex.build(docs, max_depth=8)
    got = index.speculate(context, floor=(floor_score, floor_len), **p)
    assert as_tuple(got) == brute_draft(docs, context, 8, p, (floor_score, floor_len))


def test_textbook_tree_draft():
    # Corpus: "a b c d", "a b c e", "a b x". Context ends with "a b".
    # p=2 ("a b", count 3): children c (2/3), x (1/3). Under c: d (1/2), e (1/2).
    # Best-first by D: c (2/3), x (1/3), then d and e (2/3 * 1/2 = 1/3 each) in push order.
    a, b, c, d, e, x = 1, 2, 3, 4, 5, 6
    index = SuffixIndex.build([[a, b, c, d], [a, b, c, e], [a, b, x]])
    draft = index.speculate([9, a, b], max_spec_tokens=4, max_spec_factor=4.0, min_token_prob=0.1, tree=True)
    assert draft.token_ids == [c, x, d, e]
    assert draft.parents == [-1, -1, 0, 0]
    assert draft.probs == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert draft.score == pytest.approx(5 / 3)
    assert draft.match_len == 2
    # Path mode follows the most frequent child: c, then d (tie with e broken by smaller token id).
    path = index.speculate([9, a, b], max_spec_tokens=4, max_spec_factor=4.0, min_token_prob=0.1, tree=False)
    assert (path.token_ids, path.parents) == ([c, d], [-1, 0])
    assert path.probs == pytest.approx([2 / 3, 1 / 3])
    # min_token_prob 0.4 cuts x (1/3) and the grandchildren (1/3).
    cut = index.speculate([9, a, b], max_spec_tokens=4, max_spec_factor=4.0, min_token_prob=0.4)
    assert cut.token_ids == [c]
    # MAX_SPEC = min(alpha * p, max_spec_tokens): alpha 1 and p 2 allow two nodes.
    small = index.speculate([9, a, b], max_spec_tokens=32, max_spec_factor=1.0, min_token_prob=0.1)
    assert small.token_ids == [c, x]


def test_longer_match_wins_ties_and_no_match_gives_none():
    index = SuffixIndex.build([[1, 2, 3, 4, 5]])
    draft = index.speculate([1, 2, 3], max_spec_tokens=2, max_spec_factor=4.0)
    # p = 1, 2, 3 all give [4, 5] with D = 1: score 2 each; the tie goes to p = 3.
    assert (draft.token_ids, draft.match_len, draft.score) == ([4, 5], 3, 2.0)
    assert index.speculate([7, 8]) is None


def test_accepted_len_walks_the_tree():
    draft = Draft([3, 6, 4, 5], [-1, -1, 0, 0], [0.6, 0.3, 0.3, 0.3], 1.5, 2)
    assert draft.accepted_len([3, 5, 9]) == 2
    assert draft.accepted_len([6, 4]) == 1
    assert draft.accepted_len([7]) == 0
    assert draft.paths() == [[6], [3, 4], [3, 5]]
    assert draft.depths() == [1, 1, 2, 2]


def test_drafter_uses_request_and_global_indexes():
    global_index = SuffixIndex.build([[10, 11, 12, 13, 14]])
    drafter = SuffixDrafter(global_index, max_spec_factor=4.0)
    drafter.start_request([1, 2, 3, 4, 10, 11])
    assert drafter.speculate().token_ids == [12, 13, 14]  # from the global index
    drafter.extend([20, 1, 2])
    assert drafter.speculate().token_ids[:2] == [3, 4]  # the prompt repeats: request index
    drafter.extend([3])
    drafter.finish_request()
    # The output [20, 1, 2, 3] was learned: a new request benefits.
    drafter.start_request([5, 20])
    assert drafter.speculate().token_ids[:3] == [1, 2, 3]
    assert global_index.num_sequences == 2


def test_drafter_equals_best_of_both_indexes():
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 4, size=rng.integers(0, 30)).tolist() for _ in range(20)]
    global_index = SuffixIndex.build(docs[:10])
    drafter = SuffixDrafter(global_index, max_spec_factor=2.0, merge_indexes=False)
    merged = SuffixDrafter(global_index, max_spec_factor=2.0)
    for prompt in docs[10:]:
        merged.start_request(prompt)
        drafter.start_request(prompt)
        for tok in rng.integers(0, 4, size=5).tolist():
            drafter.extend([tok])
            context = drafter.context[-64:].tolist()
            request_docs = [drafter.context.tolist()]
            req = brute.speculate(request_docs, context, 64, 32, 2.0, 0.1, True)
            floor = (req[3], req[4]) if req else (0.0, 0)
            glob = brute.speculate(docs[:10], context, 64, 32, 2.0, 0.1, True, floor)
            expected = glob or req
            got = drafter.speculate()
            assert as_tuple(got) == (expected if expected else ([], [], [], 0.0, 0))
            # The merged draft holds every path of both indexes' best trees (within the budget).
            merged.extend([tok])
            union = merged.speculate()
            alone = brute.speculate(docs[:10], context, 64, 32, 2.0, 0.1, True)
            assert len(union) <= 32
            for tree in (req, alone):
                if tree:
                    draft = Draft(*tree)
                    for path in draft.paths():
                        assert union.accepted_len(path) == len(path)
        drafter.finish_request(learn=False)
        merged.finish_request(learn=False)


paths_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=6)


@given(paths_strategy, paths_strategy, st.integers(0, 30))
@settings(max_examples=200, deadline=None)
def test_merge_keeps_every_path_within_the_limit(a_paths, b_paths, limit):
    def tree(paths):  # a valid draft tree (distinct sibling tokens): the trie of some paths
        tokens, parents, at = [], [], {}
        for path in paths:
            parent = -1
            for tok in path:
                if (parent, tok) not in at:
                    at[(parent, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                parent = at[(parent, tok)]
        return Draft(tokens, parents, [0.5] * len(tokens), 0.5 * len(tokens), 1)

    a, b = tree(a_paths).tagged(REQUEST), tree(b_paths)
    b = Draft(b.token_ids, b.parents, b.probs, b.score, 3).tagged(GLOBAL)
    union = a.merge(b, max(limit, len(a)))
    assert len(union) <= max(limit, len(a))
    assert len(union.sources) == len(union.match_lens) == len(union)
    assert all(p < i for i, p in enumerate(union.parents))
    for path in a.paths():
        assert union.accepted_len(path) == len(path)  # all of a is kept
        assert all(union.sources[i] & REQUEST for i in union.accepted_nodes(path))
    if len(union) < limit:  # room was left: all of b is in, each node knowing it came from b
        for path in b.paths():
            assert union.accepted_len(path) == len(path)
            assert all(union.sources[i] & GLOBAL and union.match_lens[i] == 3 for i in union.accepted_nodes(path))
    for cont in ([0, 1, 2], [3, 3, 3], [1, 0, 2, 3]):
        assert union.accepted_len(cont) >= max(a.accepted_len(cont), b.accepted_len(cont) if len(union) < limit else 0)


def test_drafter_rejects_misuse():
    drafter = SuffixDrafter()
    with pytest.raises(ValueError, match="start_request"):
        drafter.extend([1])
    with pytest.raises(ValueError, match="context is empty"):
        drafter.speculate([])
