"""Empirical entropy: a brute-force reference, hand-worked and constructed cases, bad arguments."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specx.core.predict.entropy import EntropyError, EntropyResult, empirical_entropy


def _bits(counter: Counter[int]) -> float:
    """n * H of a counter: total count times the entropy of its distribution, in bits."""
    n = sum(counter.values())
    return -sum(c * math.log2(c / n) for c in counter.values())


def brute_entropy(seqs: list[list[int]], max_depth: int, orders: int) -> tuple[float, list[float], int]:
    """The definition, spelled out: context -> Counter of next tokens, for every length d."""
    by_depth: dict[int, dict[tuple[int, ...], Counter[int]]] = defaultdict(lambda: defaultdict(Counter))
    for seq in seqs:
        for i in range(len(seq)):
            for d in range(1, max(max_depth, orders) + 1):
                if i + d < len(seq):  # the context seq[i:i+d] is followed by a token
                    by_depth[d][tuple(seq[i : i + d])][seq[i + d]] += 1
    weighted = sum(_bits(c) for d in range(1, max_depth + 1) for c in by_depth[d].values())
    num_contexts = sum(sum(c.values()) for d in range(1, max_depth + 1) for c in by_depth[d].values())
    entropy = weighted / num_contexts if num_contexts else 0.0
    unigram = Counter(t for seq in seqs for t in seq)
    order_bits = [_bits(unigram) / sum(unigram.values()) if unigram else math.nan]
    for k in range(1, orders + 1):
        n = sum(sum(c.values()) for c in by_depth[k].values())
        order_bits.append(sum(_bits(c) for c in by_depth[k].values()) / n if n else math.nan)
    return entropy, order_bits, num_contexts


def assert_matches_brute(seqs: list[list[int]], max_depth: int, orders: int) -> None:
    got = empirical_entropy(seqs, max_depth=max_depth, orders=orders)
    entropy, order_bits, num_contexts = brute_entropy(seqs, max_depth, orders)
    assert got.entropy_bits == pytest.approx(entropy, rel=1e-9, abs=1e-12)
    assert got.order_bits == pytest.approx(order_bits, rel=1e-9, abs=1e-12, nan_ok=True)
    assert got.num_contexts == num_contexts
    assert got.num_sequences == len(seqs)
    assert got.num_tokens == sum(len(s) for s in seqs)


corpora = st.lists(st.lists(st.integers(0, 3), max_size=24), max_size=8)


@settings(max_examples=300, deadline=None)
@given(corpora, st.integers(1, 8), st.integers(0, 5))
def test_matches_brute_force(seqs: list[list[int]], max_depth: int, orders: int) -> None:
    assert_matches_brute(seqs, max_depth, orders)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=12), min_size=1, max_size=4).map(lambda s: s * 3))
def test_matches_brute_force_repeated_outputs(seqs: list[list[int]]) -> None:
    # Repeats and binary tokens give deep shared contexts, many ends at branching nodes, and lcp
    # values past max_depth: the cases where the suffix-array pass differs most from the trie.
    assert_matches_brute(seqs, max_depth=3, orders=4)
    assert_matches_brute(seqs, max_depth=40, orders=2)


def test_worked_example() -> None:
    r = empirical_entropy([[1, 2, 3, 1, 2, 4]])
    # depth 1: 1 -> {2: 2}, 2 -> {3: 1, 4: 1}, 3 -> {1: 1}: 5 occurrences, 2 bits
    # depth 2: [1,2] -> {3: 1, 4: 1}, [2,3] -> {1}, [3,1] -> {2}: 4 occurrences, 2 bits
    # depths 3, 4, 5: 3 + 2 + 1 occurrences, 0 bits
    assert r.num_contexts == 15
    assert r.entropy_bits == pytest.approx(4 / 15)
    unigram = -(2 * (1 / 3) * math.log2(1 / 3) + 2 * (1 / 6) * math.log2(1 / 6))
    assert r.order_bits == pytest.approx([unigram, 2 / 5, 2 / 4, 0.0, 0.0])
    assert (r.num_sequences, r.num_tokens, r.max_depth) == (1, 6, 64)


def test_identical_outputs_are_free() -> None:
    # Distinct tokens, so within one copy every context has one continuation; the copies agree.
    seq = np.random.default_rng(0).permutation(1000)[:200]
    r = empirical_entropy([seq] * 10)
    assert r.entropy_bits == 0.0
    assert r.num_contexts > 0


@pytest.mark.parametrize("k", [2, 4, 8])
def test_k_equally_likely_continuations(k: int) -> None:
    # Only [5] is followed by anything; its k continuations are equally likely.
    r = empirical_entropy([[5, c] for c in range(1, k + 1)])
    assert r.entropy_bits == pytest.approx(math.log2(k), rel=1e-12)
    assert r.num_contexts == k
    assert r.order_bits[1] == pytest.approx(math.log2(k), rel=1e-12)
    assert math.isnan(r.order_bits[2])


def test_uniform_random_tokens() -> None:
    vocab = 16
    seq = np.random.default_rng(1).integers(0, vocab, size=100_000)
    r = empirical_entropy([seq], max_depth=8)
    assert r.order_bits[0] == pytest.approx(math.log2(vocab), abs=0.01)
    assert r.order_bits[1] == pytest.approx(math.log2(vocab), abs=0.01)
    # Long contexts are mostly unique, so their next token is (spuriously) certain.
    assert r.entropy_bits < r.order_bits[1]


def test_ends_are_not_outcomes() -> None:
    # [1] ends one sequence and is followed by 2 in the other: one outcome, zero bits.
    r = empirical_entropy([[1], [1, 2]])
    assert r.num_contexts == 1
    assert r.entropy_bits == 0.0


def test_empty_inputs() -> None:
    for seqs in ([], [[]], [np.zeros(0, dtype=np.int64), []]):
        r = empirical_entropy(seqs)
        assert isinstance(r, EntropyResult)
        assert (r.entropy_bits, r.num_tokens, r.num_contexts) == (0.0, 0, 0)
        assert len(r.order_bits) == 5 and all(math.isnan(b) for b in r.order_bits)
    r = empirical_entropy([[7]])
    assert r.order_bits[0] == 0.0 and math.isnan(r.order_bits[1]) and r.entropy_bits == 0.0


def test_numpy_and_list_inputs_agree() -> None:
    seqs = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    as_arrays = [np.array(s, dtype=dt) for s, dt in zip(seqs, (np.uint16, np.int64))]
    # Same tokens, different dtypes: the same text after conversion, so exactly the same result.
    assert empirical_entropy(seqs) == empirical_entropy(as_arrays)


@pytest.mark.parametrize(
    ("seqs", "kwargs", "message"),
    [
        ([[1, -2, 3]], {}, r"sequences\[0\]\[1\] = -2 is out of range"),
        ([[1, 2], [2**31]], {}, r"sequences\[1\]\[0\]"),
        ([[1.0, 2.0]], {}, "integer token ids"),
        ([np.array([0.5])], {}, "integer token ids"),
        ([[True, False]], {}, "integer token ids"),
        ([["a", "b"]], {}, "integer token ids"),
        (["abc"], {}, "token ids"),
        ([[[1, 2], [3, 4]]], {}, "flat sequence"),
        ([[1, [2, 3]]], {}, "token ids"),
        ([[1, 2]], {"max_depth": 0}, r"max_depth must be in \[1, 512\]"),
        ([[1, 2]], {"max_depth": 513}, r"max_depth must be in \[1, 512\]"),
        ([[1, 2]], {"max_depth": 2.5}, "max_depth must be an integer"),
        ([[1, 2]], {"orders": -1}, "orders must be in"),
    ],
)
def test_bad_arguments(seqs: list, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        empirical_entropy(seqs, **kwargs)


def test_error_is_a_value_error() -> None:
    assert issubclass(EntropyError, ValueError)
