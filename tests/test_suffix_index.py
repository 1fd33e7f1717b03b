"""The suffix index against the brute-force reference: counts, children, live appends, merges,
eviction, serialisation, and bad arguments."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import brute
from specx.core.index.suffix_array import SEP, build_suffix_array
from specx.core.index.suffix_index import SuffixIndex
from specx.core.index.tokens import SuffixIndexError

tokens = st.lists(st.integers(0, 3), max_size=14)
corpora = st.lists(tokens, max_size=6)
patterns = st.lists(st.integers(0, 3), max_size=4)


def all_docs(index: SuffixIndex) -> list[list[int]]:
    return [seq.tolist() for _, seq in index.sequences()]


def check_against_brute(index: SuffixIndex, pats: list[list[int]]) -> None:
    docs = all_docs(index)
    for pat in pats:
        expected = brute.count(docs, pat) if pat else sum(map(len, docs))
        assert index.count(pat) == expected, pat
        assert index.children(pat) == brute.children(docs, pat), pat


def test_textbook_example():
    # docs/design.md, "Drafting" and core/index/suffix_array.py's docstring: [1,2,3,1,2,4], pattern [1,2] ->
    # children {3: 1, 4: 1}.
    text = np.array([1, 2, 3, 1, 2, 4, SEP], dtype=np.int32)
    assert build_suffix_array(text).tolist() == [0, 3, 1, 4, 2, 5]
    index = SuffixIndex.build([[1, 2, 3, 1, 2, 4]])
    assert index.count([1, 2]) == 2
    assert index.children([1, 2]) == {3: 1, 4: 1}
    assert index.children([]) == {1: 2, 2: 2, 3: 1, 4: 1}
    assert index.count([2, 4, 1]) == 0


@given(st.lists(st.lists(st.integers(0, 2), max_size=12), max_size=5))
@settings(max_examples=200, deadline=None)
def test_suffix_array_is_sorted_suffixes(docs):
    text = []
    for d in docs:
        text += d + [SEP]
    arr = np.array(text, dtype=np.int32)
    expected = sorted((i for i in range(len(text)) if text[i] != SEP), key=lambda i: text[i:])
    assert build_suffix_array(arr).tolist() == expected


@given(corpora, st.lists(patterns, min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_bulk_build_matches_brute(docs, pats):
    check_against_brute(SuffixIndex.build(docs, max_depth=8), pats)


@given(corpora, st.lists(tokens, max_size=2), st.lists(patterns, min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_online_adds_and_live_appends_match_brute(docs, live, pats):
    index = SuffixIndex(max_depth=8)
    for d in docs:
        index.add(d)  # many small segments, merged as they grow
    for seq in live:
        seq_id = index.start(seq[: len(seq) // 2])
        for tok in seq[len(seq) // 2 :]:
            index.append(seq_id, [tok])
    assert all_docs(index) == docs + live
    check_against_brute(index, pats)


@given(st.lists(tokens, max_size=12), st.lists(st.integers(1, 5), min_size=1, max_size=12),
       st.lists(patterns, min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_adding_in_blocks_drafts_as_adding_one_by_one(docs, blocks, pats):
    one, many = SuffixIndex(max_depth=8), SuffixIndex(max_depth=8)
    for d in docs:
        one.add(d)
    i = 0
    while i < len(docs):  # blocks of any size: other segments, other merges, the same index
        size = blocks[i % len(blocks)]
        assert many.add_many(docs[i : i + size]) == list(range(i, min(i + size, len(docs))))
        i += size
    assert all_docs(many) == docs
    check_against_brute(many, pats)
    for pat in filter(None, pats):
        assert many.speculate(pat, 8, 2.0, 0.0) == one.speculate(pat, 8, 2.0, 0.0), pat


@given(st.lists(tokens, max_size=12), st.integers(0, 12), st.booleans(), st.lists(patterns, min_size=1, max_size=6))
@settings(max_examples=150, deadline=None)
def test_head_drafts_as_an_index_of_the_first_sequences(docs, num, one_by_one, pats):
    """head(n) filters the suffix arrays (no sort): counts, children and drafts are those of an
    index the first n sequences were added to, and adding to the head leaves the whole intact."""
    num = min(num, len(docs))
    whole = SuffixIndex(max_depth=8)
    if one_by_one:
        for d in docs:
            whole.add(d)  # several segments, the cut inside one
    else:
        whole.add_many(docs)
    head, first = whole.head(num), SuffixIndex.build(docs[:num], max_depth=8)
    assert all_docs(head) == docs[:num]
    check_against_brute(head, pats)
    for pat in filter(None, pats):
        assert head.speculate(pat, 8, 2.0, 0.0) == first.speculate(pat, 8, 2.0, 0.0), pat
    before = all_docs(whole)
    head.add([7, 7, 7])
    assert all_docs(whole) == before and all_docs(head) == docs[:num] + [[7, 7, 7]]
    with pytest.raises(SuffixIndexError):
        whole.head(len(docs) + 1)


@given(corpora, st.lists(patterns, min_size=1, max_size=4))
@settings(max_examples=100, deadline=None)
def test_finish_seals_live_sequence(docs, pats):
    index = SuffixIndex(max_depth=8)
    ids = []
    for d in docs:
        ids.append(index.start(d))
    for seq_id in ids:
        index.finish(seq_id)
    assert all_docs(index) == docs
    assert [seq_id for seq_id, _ in index.sequences()] == ids
    check_against_brute(index, pats)


def test_merges_keep_segment_count_logarithmic():
    index = SuffixIndex()
    rng = np.random.default_rng(0)
    for _ in range(200):
        index.add(rng.integers(0, 50, size=20))
    assert len(index.sealed.segments) <= 9  # binary-counter merging: O(log(200)) segments
    assert index.count([]) == 200 * 20


@given(corpora, st.integers(0, 400), st.lists(patterns, min_size=1, max_size=4))
@settings(max_examples=150, deadline=None)
def test_eviction_keeps_counts_of_remaining(docs, budget, pats):
    index = SuffixIndex(max_depth=8)
    for d in docs:
        index.add(d)
    dropped = index.evict(budget)
    remaining = docs[dropped:]
    assert all_docs(index) == remaining  # the oldest go first
    if remaining or dropped:
        assert index.nbytes <= budget or not remaining
    check_against_brute(index, pats)
    index.add([1, 2, 3])  # still usable afterwards
    assert index.count([1, 2, 3]) >= 1


def test_budget_enforced_on_add():
    index = SuffixIndex(budget_bytes=4000)
    rng = np.random.default_rng(1)
    for _ in range(100):
        index.add(rng.integers(0, 100, size=30))
    assert index.nbytes <= 4000
    assert 0 < index.num_sequences < 100
    newest = [seq.tolist() for _, seq in index.sequences()][-1]
    assert index.count(newest[:5]) >= 1


@given(corpora, st.lists(tokens, max_size=2), st.lists(patterns, min_size=1, max_size=4), st.booleans())
@settings(max_examples=150, deadline=None)
def test_serialise_round_trip(docs, live, pats, with_text):
    index = SuffixIndex(max_depth=8, vocab_size=4)
    for d in docs:
        index.add(d)
    live_ids = [index.start(seq) for seq in live]
    if with_text:
        loaded = SuffixIndex.from_bytes(index.to_bytes())
    else:  # compact form: suffix array as Psi deltas, text supplied by the caller
        loaded = SuffixIndex.from_bytes(index.to_bytes(include_text=False), text=index.text().copy())
        assert loaded.sealed.sa[: loaded.sealed.sa_len].tolist() == index.sealed.sa[: index.sealed.sa_len].tolist()
    assert all_docs(loaded) == all_docs(index)
    assert (loaded.max_depth, loaded.vocab_size) == (8, 4)
    check_against_brute(loaded, pats)
    # The loaded index keeps working: appends to live sequences, new adds.
    for seq_id in live_ids:
        loaded.append(seq_id, [1, 2])
    loaded.add([3, 3, 1])
    check_against_brute(loaded, pats)


def test_load_maps_arrays_without_resorting():
    index = SuffixIndex.build([[5, 6, 7, 5, 6]])
    data = index.to_bytes()
    sa_bytes = index.sealed.sa[: index.sealed.sa_len].tobytes()
    at = data.index(sa_bytes)
    # Swap the first two suffix-array entries in the serialised bytes: a loader that re-sorted
    # would repair them; one that maps the arrays returns them as stored.
    swapped = sa_bytes[4:8] + sa_bytes[0:4] + sa_bytes[8:]
    loaded = SuffixIndex.from_bytes(data[:at] + swapped + data[at + len(sa_bytes):])
    assert loaded.sealed.sa.tolist() == np.frombuffer(swapped, dtype=np.int32).tolist()
    assert not loaded.sealed.sa.flags.writeable  # a view of the bytes, copied only on first write
    good = SuffixIndex.from_bytes(data)
    good.add([5, 6])
    assert good.count([5, 6]) == 3


@pytest.mark.parametrize("data, message", [
    (b"NOTANIDX" + b"\0" * 20, "bad magic"),
    (b"SPECXIDX" + b"\x09\0\0\0" + b"\0" * 8, "version 9"),
])
def test_load_rejects_bad_bytes(data, message):
    with pytest.raises(ValueError, match=message):
        SuffixIndex.from_bytes(data)


def test_load_rejects_truncated():
    data = SuffixIndex.build([[1, 2, 3] * 50]).to_bytes()
    with pytest.raises(ValueError, match="truncated"):
        SuffixIndex.from_bytes(data[:-100])


@pytest.mark.parametrize("call, message", [
    (lambda ix: ix.add([1, -2]), r"tokens\[1\] = -2 is out of range"),
    (lambda ix: ix.add([1, 10]), r"tokens\[1\] = 10 is out of range \[0, 9\]"),
    (lambda ix: ix.add([[1, 2]]), "flat sequence"),
    (lambda ix: ix.add([1.5]), "integer token ids"),
    (lambda ix: ix.count([1] * 9), "max_depth=8"),
    (lambda ix: ix.count([99]), "out of range"),
    (lambda ix: ix.append(12345, [1]), "no live sequence with id 12345"),
    (lambda ix: ix.speculate([]), "context is empty"),
    (lambda ix: ix.speculate([1], max_spec_tokens=-1), "max_spec_tokens"),
    (lambda ix: ix.speculate([1], min_token_prob=1.5), "min_token_prob"),
    (lambda ix: ix.speculate([1], max_spec_factor=float("nan")), "max_spec_factor"),
    (lambda ix: ix.evict(-1), "budget_bytes"),
])
def test_bad_arguments_raise_value_error(call, message):
    index = SuffixIndex(max_depth=8, vocab_size=10)
    index.add([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        call(index)


@pytest.mark.parametrize("kwargs", [dict(max_depth=0), dict(max_depth=-3), dict(max_depth=10**6),
                                    dict(vocab_size=0), dict(budget_bytes=-1)])
def test_bad_constructor_arguments(kwargs):
    with pytest.raises(ValueError):
        SuffixIndex(**kwargs)


def test_empty_and_length_one_documents():
    index = SuffixIndex.build([[], [7], [], [7, 7]])
    assert index.count([7]) == 3
    assert index.children([7]) == {7: 1}
    assert index.count([]) == 3
    live = SuffixIndex()
    seq_id = live.start([])
    assert live.count([]) == 0
    live.append(seq_id, [4])
    assert live.children([]) == {4: 1}


def test_round_trip_without_text():
    docs = [[1, 2, 3], [], [2, 3, 4, 2]]
    index = SuffixIndex.build(docs)
    index.add([3, 4])
    data = index.to_bytes(include_text=False)
    assert len(data) < len(index.to_bytes())
    with pytest.raises(ValueError, match="without its text"):
        SuffixIndex.from_bytes(data)
    with pytest.raises(ValueError, match="needs"):
        SuffixIndex.from_bytes(data, text=np.zeros(3, dtype=np.int32))
    loaded = SuffixIndex.from_bytes(data, text=index.text().copy())
    check_against_brute(loaded, [[2, 3], [3], [], [4, 2]])
    assert all_docs(loaded) == docs + [[3, 4]]


def test_large_segments_use_first_token_tables():
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, 6, size=int(rng.integers(50, 400))).tolist() for _ in range(30)]
    index = SuffixIndex.build(docs, max_depth=8)
    assert index.nbytes <= 9 * index.num_tokens + 16 * 30 + 64  # the table costs under a byte a token
    assert index.sealed.segments[0].first_token_table(index.sealed.text, index.sealed.sa) is not None
    index.add([7, 7, 8])  # tokens beyond the big table's vocabulary, in a small segment
    all_ = docs + [[7, 7, 8]]
    pats = [[t] for t in range(10)] + [rng.integers(0, 6, size=int(rng.integers(2, 5))).tolist() for _ in range(20)]
    check_against_brute(index, pats + [[7, 8], [8, 7], []])
    for _ in range(15):
        ctx = rng.integers(0, 9, size=int(rng.integers(1, 10))).tolist()
        for tree in (True, False):
            got = index.speculate(ctx, max_spec_tokens=8, max_spec_factor=2.0, tree=tree)
            want = brute.speculate(all_, ctx, 8, 8, 2.0, 0.1, tree)
            assert (None if got is None else (got.token_ids, got.parents, got.probs, got.score, got.match_len)) == want
    budget = index.nbytes // 2
    dropped = index.evict(budget)
    assert index.nbytes <= budget and dropped > 0
    check_against_brute(index, pats)
