"""Tree verification: tree logits equal per-path logits, the pruned cache equals the plain one, and
the sampling accept rule draws from exactly the target distribution."""

import random

import pytest
import torch

from specx.core.decode.verify import Sampling, accept, process_logits, verify
from specx.core.draft import Draft, check_draft
from specx.core.model.transformers.engine import TransformersSession
from specx.core.model.transformers.tree import tree_logits

from helpers.models import VOCAB, prefilled, random_tree, tiny_model


def path_of(draft: Draft, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(draft.token_ids[node])
        node = draft.parents[node]
    return path[::-1]


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("num_pending", [1, 3])
def test_tree_logits_equal_path_logits(dtype, atol, attn, num_pending):
    if attn == "eager":
        atol = max(atol, 1e-5)  # eager attention takes its softmax in float32 even for float64 models
    model = tiny_model(dtype, attn)
    rng = random.Random(1)
    for num_cached in (0, 6):
        prefix = [rng.randrange(VOCAB) for _ in range(num_cached)]
        pending = [rng.randrange(VOCAB) for _ in range(num_pending)]
        draft = random_tree(rng, 12)
        with torch.no_grad():
            rows = tree_logits(model, prefilled(model, prefix), pending, draft, linear=None)  # [P + N, V]
            for j in range(num_pending):  # pending rows: plain causal logits
                ref = model(input_ids=torch.tensor([prefix + pending[: j + 1]])).logits[0, -1]
                torch.testing.assert_close(rows[j], ref, atol=atol, rtol=0)
            for i in range(len(draft)):
                ref = model(input_ids=torch.tensor([prefix + pending + path_of(draft, i)])).logits[0, -1]
                torch.testing.assert_close(rows[num_pending + i], ref, atol=atol, rtol=0)


def test_verify_prunes_cache_to_the_accepted_path():
    model = tiny_model()
    prefix = [5, 17, 3, 80, 41]
    pending = [9]
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([prefix + pending])).logits[0, -1]
        first = int(plain.argmax())
        second = int(model(input_ids=torch.tensor([prefix + pending + [first]])).logits[0, -1].argmax())
    wrong = [(first + 1) % VOCAB, (first + 2) % VOCAB]
    # the accepted path (first -> second) is nodes 2 and 4, not a prefix of the node list: gather needed
    draft = Draft([wrong[0], wrong[1], first, 7, second, 8], [-1, 0, -1, 2, 2, 4], [0.1] * 6, 0.6, 1)
    cache = prefilled(model, prefix)
    verdict = verify(TransformersSession(model, cache), pending, draft, Sampling())
    assert verdict.accepted_nodes[:2] == [2, 4]
    assert verdict.tokens[:2] == [first, second]
    kept = prefix + pending + verdict.tokens[:-1]
    assert cache.get_seq_length() == len(kept)
    ref = prefilled(model, kept)
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-9, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-9, rtol=0)


def test_verify_guesses_what_follows_each_rejected_child():
    # Verdict.guesses: for each rejected child of the last accepted node (here of the root, then of
    # an accepted node), the model's argmax after it: rows the pass computed anyway
    model = tiny_model()
    prefix, pending = [5, 17, 3, 80, 41], [9]

    def after(tokens):
        return int(model(input_ids=torch.tensor([prefix + pending + tokens])).logits[0, -1].argmax())

    def session():  # the model's KV cache of the prefix, as a request's
        return TransformersSession(model, prefilled(model, prefix))

    with torch.no_grad():
        first = after([])
        second = after([first])
        wrong = [(first + 1) % VOCAB, (first + 2) % VOCAB, (second + 1) % VOCAB]
        roots_wrong = verify(session(), pending, Draft(wrong[:2], [-1, -1], [0.5] * 2, 1, 1), Sampling())
        assert roots_wrong.accepted_nodes == []
        assert roots_wrong.guesses == list(dict.fromkeys([after([wrong[0]]), after([wrong[1]])]))
        draft = Draft([wrong[0], first, wrong[2]], [-1, -1, 1], [0.5] * 3, 1.5, 1)
        child_wrong = verify(session(), pending, draft, Sampling())
        assert child_wrong.accepted_nodes == [1] and child_wrong.tokens == [first, second]
        assert child_wrong.guesses == [after([first, wrong[2]])]  # not the rejected root's: that branch is gone
        all_right = verify(session(), pending, Draft([first], [-1], [0.5], 0.5, 1), Sampling())
        assert all_right.guesses == []  # the accepted path ended at a leaf: nothing was rejected there


def test_check_draft_rejects_malformed_trees():
    with pytest.raises(ValueError, match="parent"):
        check_draft(Draft([1, 2], [-1, 1], [], 0, 0), VOCAB)
    with pytest.raises(ValueError, match="vocabulary"):
        check_draft(Draft([1, VOCAB], [-1, 0], [], 0, 0), VOCAB)
    with pytest.raises(ValueError, match="parents"):
        check_draft(Draft([1, 2], [-1], [], 0, 0), VOCAB)


def test_process_logits_hand_worked():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert process_logits(logits, Sampling(1.0)).tolist() == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])
    # top-k 2 keeps {0.5, 0.2} -> renormalised 5/7, 2/7
    assert process_logits(logits, Sampling(1.0, top_k=2)).tolist() == pytest.approx([5 / 7, 2 / 7, 0, 0, 0])
    # top-p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 joins (0.85 >= 0.8) and the rest go
    assert process_logits(logits, Sampling(1.0, top_p=0.8)).tolist() == pytest.approx([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    # temperature 0.5 squares the probabilities before renormalising
    sq = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    assert process_logits(logits, Sampling(0.5)).tolist() == pytest.approx((sq / sq.sum()).tolist())


# --- sampling is lossless: a statistical test -------------------------------------------------

# chi-square critical value at significance 1e-4 for 5 degrees of freedom (6 tokens)
CHI2_CRIT_DF5 = 25.74
NUM_DRAWS = 6000


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def biased_accept(logits, draft, sampling):
    """A plausible-looking but wrong rule: accept the draft token with its own probability, else
    sample afresh (it forgets to remove the draft token's mass from the second draw)."""
    probs = process_logits(logits[0], sampling)
    tok = draft.token_ids[0]
    if torch.rand((), dtype=torch.float64, generator=sampling.generator) < probs[tok]:
        return tok
    return int(torch.multinomial(probs, 1, generator=sampling.generator))


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.7)])
def test_sampling_accept_matches_target_distribution(top_k, top_p):
    # A 6-token vocabulary; the draft proposes token 1 then (on a second level) token 4 or 5.
    root = torch.tensor([1.0, 0.6, 0.2, -0.3, 0.4, -1.0], dtype=torch.float64)
    child = torch.tensor([-0.5, 0.1, 0.9, 0.0, 0.3, 0.2], dtype=torch.float64)
    logits = torch.stack([root, child, child, child])  # [1 + N, V]: row 0 = root, row 1 + i = node i
    draft = Draft([1, 4, 5], [-1, 0, 0], [0.3, 0.2, 0.1], 0.6, 1)
    sampling = Sampling(0.9, top_k, top_p, torch.Generator().manual_seed(1234))
    target_root = process_logits(root, sampling).tolist()
    target_child = process_logits(child, sampling).tolist()

    first_counts, second_counts = [0] * 6, [0] * 6
    for _ in range(NUM_DRAWS):
        tokens = accept(logits, draft, 0, sampling).tokens
        first_counts[tokens[0]] += 1
        if tokens[0] == 1:  # moved to node 0: the next token follows node 0's distribution
            second_counts[tokens[1]] += 1
    assert chi_square(first_counts, target_root) < CHI2_CRIT_DF5
    assert chi_square(second_counts, target_child) < CHI2_CRIT_DF5

    # The same test catches a biased rule: with p(token 1) ~ 0.27 it emits token 1 with chance
    # ~0.27 + 0.73 * 0.27 ~ 0.47, a chi-square in the hundreds.
    biased = [0] * 6
    for _ in range(NUM_DRAWS):
        biased[biased_accept(logits, draft, sampling)] += 1
    assert chi_square(biased, target_root) > 10 * CHI2_CRIT_DF5
    # ... and so would "always accept the draft token": every draw is token 1.
    assert chi_square([0, NUM_DRAWS, 0, 0, 0, 0], target_root) > 10 * CHI2_CRIT_DF5


def test_greedy_accept_walks_argmax_children():
    logits = torch.full((4, 6), -5.0, dtype=torch.float64)
    logits[0, 2] = 1  # root: argmax 2 -> node 1 (carries 2)
    logits[2, 3] = 1  # node 1: argmax 3 -> node 2 (carries 3)
    logits[3, 0] = 1  # node 2: argmax 0, no such child -> bonus 0
    draft = Draft([1, 2, 3], [-1, -1, 1], [], 0, 0)
    verdict = accept(logits, draft, 0, Sampling())
    assert verdict.tokens == [2, 3, 0]
    assert verdict.accepted_nodes == [1, 2]
