"""Cost-aware draft sizing: the measured forward-pass curve decides how much draft a step verifies."""

import random

import pytest

from specx.bench.calibrate import calibrate
from specx.core.cost.forward import ForwardCost
from specx.core.cost.sizing import size_draft
from specx.core.decode.generate import generate, greedy_decode
from specx.core.decode.request import Decoding
from specx.core.draft import Draft, subtree
from specx.core.model.transformers.engine import TransformersEngine

from helpers.decoding import FakeDrafter, all_right, wide_tree
from helpers.models import tiny_model


def tree_with_probs(rng, n):
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    probs = []
    for p in parents:  # a child is never likelier than its parent, as in suffix drafts
        probs.append(rng.uniform(0.05, 1.0) if p < 0 else probs[p] * rng.uniform(0.1, 1.0))
    tokens = rng.sample(range(1000), n)  # distinct, so no two siblings share a token (drafts never do)
    return Draft(tokens, parents, probs, sum(probs), 1)


def brute_best_rate(draft, cost, pending=1):
    order = sorted(range(len(draft)), key=lambda i: (-draft.probs[i], i))
    rates = [(1 + sum(draft.probs[i] for i in order[:k])) / cost(pending + k) for k in range(len(order) + 1)]
    return max(rates)


@pytest.mark.parametrize("seed", range(30))
def test_size_draft_maximises_expected_tokens_per_second(seed):
    rng = random.Random(seed)
    draft = tree_with_probs(rng, rng.randrange(1, 40))
    cost = ForwardCost((1, 8, 32, 64), (1.0, 1.0 + rng.uniform(0, 0.5), 1.5 + rng.uniform(0, 2), 4.0))
    cut = size_draft(draft, cost)
    assert all(p < i for i, p in enumerate(cut.parents))  # still a tree
    rate = (1 + sum(cut.probs)) / cost(1 + len(cut))
    assert rate == pytest.approx(brute_best_rate(draft, cost))
    for path in cut.paths():  # every kept path is a path of the original draft
        assert draft.accepted_len(path) == len(path)


def test_flat_cost_keeps_everything_and_steep_cost_keeps_nothing():
    draft = Draft([1, 2, 3], [-1, 0, 1], [0.9, 0.8, 0.1], 1.8, 2)
    assert size_draft(draft, ForwardCost((1, 64), (1.0, 1.0))).token_ids == [1, 2, 3]  # GPU-like
    assert size_draft(draft, ForwardCost((1, 64), (1.0, 64.0))).token_ids == []  # every token costs a pass
    # In between: the 0.1 node does not pay for itself, the others do.
    assert size_draft(draft, ForwardCost((1, 2, 3, 4), (1.0, 1.2, 1.4, 1.6))).token_ids == [1, 2]


def test_cost_interpolates_and_extrapolates():
    cost = ForwardCost((1, 8, 32), (1.0, 2.0, 5.0))
    assert cost(1) == 1.0 and cost(8) == 2.0 and cost(20) == pytest.approx(3.5)
    assert cost(64) == pytest.approx(9.0)  # the last slope, continued


def test_subtree_drops_orphans():
    draft = Draft([5, 6, 7, 8], [-1, 0, 1, -1], [0.5, 0.4, 0.3, 0.2], 1.4, 1)
    assert subtree(draft, [True, False, True, True]).token_ids == [5, 8]  # 7 lost its parent


def test_generation_with_cost_sizing_stays_lossless():
    model = tiny_model()
    rng = random.Random(3)
    cost = calibrate(model, sizes=(1, 4, 16), repeats=1, context=16)
    assert len(cost.seconds) == 3 and all(s > 0 for s in cost.seconds)
    for trial in range(6):
        prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(2, 12))]
        reference = greedy_decode(model, prompt, 20)
        steep = ForwardCost((1, 64), (1.0, rng.choice([1.5, 8.0, 64.0])))
        for make in (all_right, wide_tree):
            out = [t for s in generate(TransformersEngine(model), prompt, FakeDrafter(make, reference),
                                       Decoding(max_new_tokens=20), cost=steep)
                   for t in s.new_tokens]
            assert out == reference


def test_a_longer_cache_makes_verified_tokens_dearer():
    cost = ForwardCost((1, 8), (1.0, 2.0), 128, (1.5, 4.5), 1024)
    assert cost(8) == cost(8, 128) == 2.0 and cost(8, 1024) == 4.5
    assert cost(8, 576) == pytest.approx(3.25) and cost(1, 576) == pytest.approx(1.25)
    assert cost(8, 2048) > cost(8, 1024)  # linear beyond the measured contexts
    draft = Draft([1, 2, 3], [-1, 0, 1], [0.5, 0.5, 0.5], 1.5, 3)
    flat_then_steep = ForwardCost((1, 4), (1.0, 1.2), 128, (1.0, 4.0), 1024)
    assert size_draft(draft, flat_then_steep, context=128).token_ids == [1, 2, 3]
    assert size_draft(draft, flat_then_steep, context=1024).token_ids == []


def test_acceptance_model_starts_from_the_drafters_scores_and_learns_overconfidence():
    from specx.core.cost.acceptance import AcceptanceModel

    model = AcceptanceModel(prior=2.0)
    draft = Draft([1, 2, 3], [-1, 0, 1], [0.9, 0.81, 0.729], 2.439, 3)
    assert model.estimates(draft) == pytest.approx(draft.probs)  # no verdicts yet: D itself
    cost = ForwardCost((1, 2, 3, 4), (1.0, 1.2, 1.4, 1.6))
    assert size_draft(draft, cost, acceptance=model).token_ids == [1, 2, 3]
    model.update(draft, [])  # the root was tried and rejected; its children were never reached
    assert model.tried.sum() == 1 and model.accepted.sum() == 0
    assert model.estimates(draft)[0] == pytest.approx(2 * 0.9 / 3)  # one verdict moves it, not all the way
    for _ in range(20):
        model.update(draft, [])
    assert model.estimates(draft)[0] < 0.1
    assert size_draft(draft, cost, acceptance=model).token_ids == []
    for _ in range(200):  # and it recovers when such drafts are accepted
        model.update(draft, [0, 1, 2])
    assert model.estimates(draft)[0] > 0.9
    assert size_draft(draft, cost, acceptance=model).token_ids == [1, 2, 3]


def test_acceptance_model_tells_cells_apart_and_keeps_a_tree():
    from specx.core.cost.acceptance import AcceptanceModel
    from specx.core.draft import GLOBAL, REQUEST

    model = AcceptanceModel(prior=2.0, window=64)
    own = Draft([5, 6], [-1, 0], [1.0, 1.0], 2.0, 2).tagged(REQUEST)
    past = Draft([7, 8], [-1, 0], [1.0, 1.0], 2.0, 2).tagged(GLOBAL)
    for _ in range(100):  # the request's own continuations hold, other requests' do not
        model.update(own, [0, 1])
        model.update(past, [])
    assert model.tried.max() < 64  # halved at the window
    merged = past.merge(own, 8)  # the global draft first, as a higher score would put it
    assert merged.sources == [GLOBAL, GLOBAL, REQUEST, REQUEST]
    est = model.estimates(merged)
    assert est[2] > 0.9 and est[3] > 0.9 and est[0] < 0.1 and est[1] <= est[0]
    cost = ForwardCost((1, 2, 3, 4, 5), (1.0, 1.1, 1.2, 1.3, 1.4))
    assert size_draft(merged, cost, acceptance=model).token_ids == [5, 6]
    deep = Draft([1, 2, 3, 4], [-1, 0, 1, 2], [1.0] * 4, 4.0, 1)
    for _ in range(100):  # 1-token matches: the root holds, deeper nodes do not
        model.update(deep, [0])
    est = model.estimates(deep)
    assert est == sorted(est, reverse=True) and est[0] > 0.9 and est[1] < 0.1


# --------------------------------------------------------------- a curve kept per model and machine



def test_check_curve_worked_cases():
    from specx.core.cost.forward import check_curve
    from specx.core.cost.shipped import shipped_curves

    assert check_curve(shipped_curves()["cpu"].cost) is None  # the shipped, measured curve is believable
    assert check_curve(ForwardCost((1, 2), (0.03, 0.03), 16, (0.03, 0.2), 64)) is not None  # the long curve too


def test_a_fixed_curve_caps_nothing_and_learns_nothing():
    """The decode loop asks every cost the same (core.cost.forward.PassCost): a fixed curve, measured
    or a projection's relative one, answers with no cap, its own shape, and ignores the steps."""
    from specx.core.predict.curves import CostCurve

    for cost in (ForwardCost((1, 8), (0.01, 0.02)), CostCurve("c", ForwardCost((1, 8), (1.0, 2.0)))):
        before = cost(8)
        cost.observe_step(num_tokens=8, context=128, verify_seconds=9.0, step_seconds=9.0, num_out=1)
        assert cost.max_draft() is None and cost(8) == before and cost.shape(8) == pytest.approx(2.0)
