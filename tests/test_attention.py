"""The quantized engine's attention (core/model/quantized/attention.py) against a float64 reference, and
its bits: a row's output is the same alone, in a tree, in a prefill, beside other sequences, and
with its visible keys cached or new, at contexts that span many parts; for the ways of keeping
keys and values (int8 with scales, float16)."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from specx.core.model.quantized.attention import attention
from specx.core.model.quantized.keys import Q8_ROWS, key_layout, key_store
from specx.core.model.quantized.values import stored_values, value_layout, value_store
from specx.core.model.quantized import target
from specx.core.model.quantized.arch import FAMILIES
from specx.core.model.quantized.kernel import quantize_rows

GROUP, DIM, KV_HEADS = 3, 64, 2
HEADS = GROUP * KV_HEADS
SCALE = np.float32(1 / 8)
FORMATS = [("q8", "bf16"), ("f16", "f16")]  # (keys, values)
MIXED = [("q8", "f16"), ("f16", "bf16")]


def cache(keys: np.ndarray, values: np.ndarray, capacity: int, fmt: tuple[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [N, Hkv, D] in the engine's layout (the engine's own stores): keys [Hkv, C /
    16, rows, 16] (key_layout), values [Hkv, C / 16, rows, width] (value_layout); the rest of the
    capacity holds garbage, as np.empty would."""
    rng = np.random.default_rng(99)
    rows, dtype = key_layout(DIM, fmt[0])
    kt = rng.integers(0, np.iinfo(dtype).max, (KV_HEADS, capacity // 16, rows, 16), dtype=dtype)
    vrows, width, vtype = value_layout(DIM, fmt[1])
    vc = np.zeros((KV_HEADS, capacity // 16, vrows, width), dtype=vtype)  # finite garbage: weighed 0 past the end
    value_store(fmt[1])(vc, rng.standard_normal((capacity, KV_HEADS, DIM), dtype=np.float32) * 1e3, 0, capacity, 0)
    key_store(fmt[0])(kt, np.ascontiguousarray(keys, dtype=np.float32), 0, keys.shape[0], 0)
    value_store(fmt[1])(vc, np.ascontiguousarray(values, dtype=np.float32), 0, keys.shape[0], 0)
    return kt, vc


def stored_keys(keys: np.ndarray, fmt: str) -> np.ndarray:
    """What the cache holds of keys [N, Hkv, D], as float64: float16, or int8 times its scale (read
    back from the packed words: byte i of word r is dimension 4 r + i, plus 128)."""
    if fmt == "f16":
        return keys.astype(np.float16).astype(np.float64)
    kt, _ = cache(keys, keys, -(-keys.shape[0] // 16) * 16, (fmt, "f16"))
    n, out = keys.shape[0], np.zeros(keys.shape)
    for j in range(n):
        for b in range(DIM // 32):
            words = kt[:, j // 16, Q8_ROWS * b : Q8_ROWS * b + 8, j % 16]  # [Hkv, 8]
            ints = words.astype("<u4").view(np.uint8).reshape(KV_HEADS, 32).astype(np.int64) - 128
            scale = kt[:, j // 16, Q8_ROWS * b + 8, j % 16].view(np.float32).astype(np.float64)
            out[j, :, 32 * b : 32 * b + 32] = ints * scale[:, None]
    return out


def query_as_scored(q: np.ndarray, fmt: str) -> np.ndarray:
    """Queries [R, H, D] as float64 the way the keys' format scores them: int8 times scale for int8 keys."""
    if fmt == "f16":
        return q.astype(np.float64)
    flat = np.ascontiguousarray(q.reshape(-1, DIM), dtype=np.float32)
    m = flat.shape[0]
    q8, dx = np.empty((DIM // 4, m, 4), np.int8), np.empty((DIM // 32, m), np.float32)
    quantize_rows(flat, q8, dx, np.empty((DIM // 16, m), np.int32), np.empty((DIM // 32, m), np.float32))
    ints = q8.transpose(1, 0, 2).reshape(m, DIM).astype(np.float64)
    return (ints * np.repeat(dx.T.astype(np.float64), 32, axis=1)).reshape(q.shape)


def bfloat(x: np.ndarray) -> np.ndarray:
    """float32s rounded to bfloat16 (ties to even), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return rounded.view(np.float32).astype(np.float64)


def run(block: int, seqs: list[tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]],
        fmt: tuple[str, str] = FORMATS[0], family: str | None = None) -> np.ndarray:
    """One pass over sequences (keys [N, Hkv, D], values, n_cached, allowed [R, R], q [R, H, D]): out [sum R, H, D]."""
    attend = attention(GROUP, DIM, block, keys=fmt[0], family=family, values=fmt[1])
    key_lists, value_lists, n0s, alloweds, qs, starts = [], [], [], [], [], [0]
    for keys, values, n0, allowed, q in seqs:
        capacity = -(-keys.shape[0] // 16) * 16 + 32
        kt, vc = cache(keys, values, capacity, fmt)
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


def reference(keys: np.ndarray, values: np.ndarray, n0: int, allowed: np.ndarray, q: np.ndarray,
              fmt: tuple[str, str] = FORMATS[0], block: int = 1 << 30) -> np.ndarray:
    """float64 softmax attention over each row's visible entries, keys and values as the cache keeps
    them, queries as they are scored against them; bfloat16 values' weights rounded as the kernel
    rounds them (relative to their part's largest: parts of `block` positions)."""
    k = stored_keys(keys, fmt[0])
    n = keys.shape[0]
    v = stored_values(cache(keys, values, -(-n // 16) * 16, fmt)[1], n, fmt[1]).astype(np.float64)
    qf = query_as_scored(q, fmt[0])
    out = np.zeros(q.shape)
    for s in range(q.shape[0]):
        seen = list(range(n0)) + [n0 + i for i in range(allowed.shape[1]) if allowed[s, i]]
        for h in range(HEADS):
            g = h // GROUP
            logits = k[seen, g] @ qf[s, h] * float(SCALE)
            top = logits.max()
            total, acc = 0.0, np.zeros(DIM)
            for a in range(0, len(seen), block):
                part = logits[a : a + block]
                p = np.exp(part - part.max())
                weights = bfloat(p) if fmt[1] == "bf16" else p  # bfloat16 values are weighed in bfloat16
                total += np.exp(part.max() - top) * p.sum()
                acc += np.exp(part.max() - top) * (weights @ v[seen[a : a + block], g])
            out[s, h] = acc / total
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


@pytest.mark.parametrize("fmt", FORMATS + MIXED, ids="/".join)
@pytest.mark.parametrize("block", [16, 48, 512])
@pytest.mark.parametrize("n0", [0, 5, 47, 48, 130])
def test_matches_a_float64_reference(block, n0, fmt):
    rng = np.random.default_rng(n0 * 7 + block)
    seq = random_sequence(rng, n0, tree_mask(TREE, 2))
    got, want = run(block, [seq], fmt), reference(*seq, fmt, block)
    tight = np.isclose(got, want, rtol=2e-5, atol=2e-6).all(axis=2)  # per (row, head)
    if fmt[1] == "f16":
        assert tight.all()
    else:  # float32's weights and float64's may round to bfloat16 an ulp apart: one step of 2^-8
        assert np.allclose(got, want, rtol=2e-5, atol=1e-3) and tight.mean() > 0.95


@pytest.mark.parametrize("fmt", [("q8", "f16"), ("f16", "bf16")], ids=["int8-keys", "bfloat16-values"])
def test_int8_keys_or_bfloat16_values_stay_near_float16_ones(fmt):
    """They approximate float16's: the outputs stay within a few % of the values' scale (1)."""
    rng = np.random.default_rng(3)
    seq = random_sequence(rng, 300, tree_mask([], 4))
    assert np.abs(run(512, [seq], fmt) - run(512, [seq], ("f16", "f16"))).max() < 0.05


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "generic"])
def test_every_family_gives_the_same_bits(family):
    """Int8 keys' integer dots are exact in every instruction-set family and the float steps the same;
    bfloat16 values' pairs in plain IR are vdpbf16ps's arithmetic (where the CPU has it)."""
    if not target.runs_here(family):
        pytest.skip(f"this CPU does not execute {family}")
    rng = np.random.default_rng(11)
    seq = random_sequence(rng, 90, tree_mask(TREE, 2))
    assert np.array_equal(run(48, [seq], FORMATS[0], family), run(48, [seq], FORMATS[0], "generic"))


def alone(block: int, keys, values, n0, allowed, q, s: int, fmt: tuple[str, str]) -> np.ndarray:
    """Row s as plain decoding computes it: its visible entries all cached in order, itself the one new row."""
    seen = list(range(n0)) + [n0 + i for i in range(allowed.shape[1]) if allowed[s, i]]
    k, v = keys[seen], values[seen]
    return run(block, [(k, v, len(seen) - 1, np.ones((1, 1), np.uint8), q[s : s + 1])], fmt)[0]


@pytest.mark.parametrize("fmt", FORMATS, ids="/".join)
@pytest.mark.parametrize("block", [16, 512])
@pytest.mark.parametrize("n0", [3, 40, 44, 200, 507])
def test_a_row_gets_the_same_bits_alone_as_in_any_pass(block, n0, fmt):
    """44 + 1 pending (block 16) and 507 + 1 (block 512): a branch's gathered ancestors cross a part's edge."""
    rng = np.random.default_rng(n0 + block)
    for allowed in (tree_mask(TREE, 1), tree_mask(TREE, 3), tree_mask([], 37), tree_mask(list(range(-1, 20)), 1)):
        seq = random_sequence(rng, n0, allowed)
        got = run(block, [seq], fmt)
        for s in range(allowed.shape[0]):
            assert np.array_equal(got[s], alone(block, *seq, s, fmt)), (allowed.shape, s)


@pytest.mark.parametrize("fmt", FORMATS, ids="/".join)
def test_sequences_in_one_pass_get_the_bits_of_their_own_passes(fmt):
    rng = np.random.default_rng(5)
    seqs = [random_sequence(rng, 70, tree_mask(TREE, 2)), random_sequence(rng, 3, tree_mask([], 20)),
            random_sequence(rng, 500, tree_mask([-1], 1))]
    together = run(32, seqs, fmt)
    at = 0
    for seq in seqs:
        rows = seq[3].shape[0]
        assert np.array_equal(together[at : at + rows], run(32, [seq], fmt))
        at += rows


@pytest.mark.parametrize("fmt", FORMATS, ids="/".join)
def test_the_cache_grows_keeps_a_path_and_copies_its_entries_whole(fmt):
    """KVCache's own moves (reserve, keep, copy) carry each position's key and value whole, in both
    layouts: a value lies in two halves of words (bfloat16) or a row (float16), a key in a lane."""
    from specx.core.model.quantized.engine import KVCache
    from specx.core.model.quantized.model import Config

    cfg = Config("llama", 2, 384, 1024, GROUP * KV_HEADS, KV_HEADS, DIM, DIM, 10000.0, 1e-5, 2048, 100,
                 keys=fmt[0], values=fmt[1])
    rng = np.random.default_rng(8)
    kv, n = KVCache(cfg, 16), 40
    kv.reserve(n)  # grown from 16
    for kc, vc in zip(kv.keys, kv.values):
        key_store(fmt[0])(kc, rng.standard_normal((n, KV_HEADS, DIM), dtype=np.float32), 0, n, 0)
        value_store(fmt[1])(vc, rng.standard_normal((n, KV_HEADS, DIM), dtype=np.float32), 0, n, 0)
    kv.length = n

    def entry(cache: KVCache, layer: int, p: int) -> tuple[np.ndarray, np.ndarray]:
        return (cache.keys[layer][:, p // 16, :, p % 16].copy(),
                stored_values(cache.values[layer], p + 1, fmt[1])[p].copy())

    before = [[entry(kv, layer, p) for p in range(n)] for layer in range(2)]
    kv.keep(10, [17, 23, 39])  # a draft path accepted: three entries moved down
    copy = kv.copy(13)
    for cache in (kv, copy):
        assert cache.length == 13
        for layer in range(2):
            for p, src in enumerate([*range(10), 17, 23, 39]):
                got, want = entry(cache, layer, p), before[layer][src]
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (layer, p, src)
