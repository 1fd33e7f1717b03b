"""The quantized engine's attention (core/model/quantized/attention.py) against a float64 reference, and
its bits: a row's output is the same alone, in a tree, in a prefill, beside other sequences, and
with its visible keys cached or new, at contexts that span many parts."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from specx.core.model.quantized.attention import attention

GROUP, DIM, KV_HEADS = 3, 64, 2
HEADS = GROUP * KV_HEADS
SCALE = np.float32(1 / 8)


def cache(keys: np.ndarray, values: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 keys and values [N, Hkv, D] in the engine's layout (its bits): keys [Hkv, C / 16, D, 16],
    values [Hkv, C, D]; the rest of the capacity holds garbage, as np.empty would."""
    n = keys.shape[0]
    rng = np.random.default_rng(99)
    kt = rng.integers(0, 2**16, (KV_HEADS, capacity // 16, DIM, 16), dtype=np.uint16)
    vc = rng.integers(0, 2**16, (KV_HEADS, capacity, DIM), dtype=np.uint16)
    for j in range(n):
        kt[:, j // 16, :, j % 16] = keys[j].astype(np.float16).view(np.uint16)
        vc[:, j] = values[j].astype(np.float16).view(np.uint16)
    return kt, vc


def run(block: int, seqs: list[tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]]) -> np.ndarray:
    """One pass over sequences (keys [N, Hkv, D], values, n_cached, allowed [R, R], q [R, H, D]): out [sum R, H, D]."""
    attend = attention(GROUP, DIM, block)
    key_lists, value_lists, n0s, alloweds, qs, starts = [], [], [], [], [], [0]
    for keys, values, n0, allowed, q in seqs:
        capacity = -(-keys.shape[0] // 16) * 16 + 32
        kt, vc = cache(keys, values, capacity)
        key_lists.append(numba.typed.List([kt]))
        value_lists.append(numba.typed.List([vc]))
        n0s.append(n0)
        alloweds.append(allowed.astype(np.uint8))
        qs.append(q)
        starts.append(starts[-1] + q.shape[0])
    q = np.concatenate(qs).astype(np.float32)
    out = np.zeros_like(q)
    attend(q, numba.typed.List(key_lists), numba.typed.List(value_lists), 0, np.array(starts, dtype=np.int64),
           np.array(n0s, dtype=np.int64), numba.typed.List(alloweds), SCALE, out)
    return out


def reference(keys: np.ndarray, values: np.ndarray, n0: int, allowed: np.ndarray, q: np.ndarray) -> np.ndarray:
    """float64 softmax attention over each row's visible entries, keys and values rounded to float16."""
    k = keys.astype(np.float16).astype(np.float64)
    v = values.astype(np.float16).astype(np.float64)
    out = np.zeros(q.shape)
    for s in range(q.shape[0]):
        seen = list(range(n0)) + [n0 + i for i in range(allowed.shape[1]) if allowed[s, i]]
        for h in range(HEADS):
            g = h // GROUP
            logits = k[seen, g] @ q[s, h].astype(np.float64) * float(SCALE)
            p = np.exp(logits - logits.max())
            out[s, h] = p @ v[seen, g] / p.sum()
    return out


def random_sequence(rng: np.random.Generator, n0: int, allowed: np.ndarray):
    rows = allowed.shape[0]
    keys = rng.standard_normal((n0 + rows, KV_HEADS, DIM)).astype(np.float32)
    values = rng.standard_normal((n0 + rows, KV_HEADS, DIM)).astype(np.float32)
    q = (rng.standard_normal((rows, HEADS, DIM)) * 2).astype(np.float32)
    return keys, values, n0, allowed, q


def tree_mask(parents: list[int], pending: int) -> np.ndarray:
    """`pending` committed tokens in a chain, then draft nodes (parents[i] < i, -1 under the last pending)."""
    rows = pending + len(parents)
    allowed = np.zeros((rows, rows), dtype=np.uint8)
    for s in range(pending):
        allowed[s, : s + 1] = 1
    for i, parent in enumerate(parents):
        s = pending + i
        allowed[s] = allowed[pending - 1 if parent < 0 else pending + parent]
        allowed[s, s] = 1
    return allowed


TREE = [-1, 0, 0, 1, 2, -1, 5, 3]  # two roots, branches: rows see non-contiguous ancestors


@pytest.mark.parametrize("block", [16, 48, 512])
@pytest.mark.parametrize("n0", [0, 5, 47, 48, 130])
def test_matches_a_float64_reference(block, n0):
    rng = np.random.default_rng(n0 * 7 + block)
    seq = random_sequence(rng, n0, tree_mask(TREE, 2))
    got = run(block, [seq])
    assert np.allclose(got, reference(*seq), rtol=2e-5, atol=2e-6)


def alone(block: int, keys, values, n0, allowed, q, s: int) -> np.ndarray:
    """Row s as plain decoding computes it: its visible entries all cached in order, itself the one new row."""
    seen = list(range(n0)) + [n0 + i for i in range(allowed.shape[1]) if allowed[s, i]]
    k, v = keys[seen], values[seen]
    return run(block, [(k, v, len(seen) - 1, np.ones((1, 1), np.uint8), q[s : s + 1])])[0]


@pytest.mark.parametrize("block", [16, 512])
@pytest.mark.parametrize("n0", [3, 40, 44, 200, 507])
def test_a_row_gets_the_same_bits_alone_as_in_any_pass(block, n0):
    """44 + 1 pending (block 16) and 507 + 1 (block 512): a branch's gathered ancestors cross a part's edge."""
    rng = np.random.default_rng(n0 + block)
    for allowed in (tree_mask(TREE, 1), tree_mask(TREE, 3), tree_mask([], 37), tree_mask(list(range(-1, 20)), 1)):
        seq = random_sequence(rng, n0, allowed)
        got = run(block, [seq])
        for s in range(allowed.shape[0]):
            assert np.array_equal(got[s], alone(block, *seq, s)), (allowed.shape, s)


def test_sequences_in_one_pass_get_the_bits_of_their_own_passes():
    rng = np.random.default_rng(5)
    seqs = [random_sequence(rng, 70, tree_mask(TREE, 2)), random_sequence(rng, 3, tree_mask([], 20)),
            random_sequence(rng, 500, tree_mask([-1], 1))]
    together = run(32, seqs)
    at = 0
    for seq in seqs:
        rows = seq[3].shape[0]
        assert np.array_equal(together[at : at + rows], run(32, [seq]))
        at += rows
