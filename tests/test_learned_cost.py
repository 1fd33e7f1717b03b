"""The forward-pass cost learned from the passes (core.decode.learned_cost) and the thread count chosen
from them (core.model.threads): simulated passes with a known cost and a load that changes, so that
nothing here depends on this machine's timing."""

import json
import math
import random

import numpy as np
import pytest

from specx.core.decode.cost import ForwardCost
from specx.core.decode.learned_cost import GUARD_STEPS, SIZES, LearnedCost, _sane
from specx.core.model.threads import ThreadTuner

SHIPPED_LIKE = ForwardCost((1, 8, 16, 32, 64), (0.031, 0.035, 0.047, 0.077, 0.127))  # flat-ish (AVX-512)
STEEP = lambda n: 0.05 * (1 + 0.17 * (n - 1))  # noqa: E731  - steep (this AVX2 machine): 16 tokens ~3.5x one


def busy_passes(cost, true_seconds, passes=600, seed=0, noise=0.15):
    """Passes of random sizes, as sizing picks them, on a machine whose load wanders 10x (slowly,
    with spikes) and whose timing is noisy."""
    rng = random.Random(seed)
    load, now = 1.0, 0.0
    for _ in range(passes):
        load = min(max(load * math.exp(rng.gauss(0, 0.15)), 0.5), 10.0)
        spike = 4.0 if rng.random() < 0.03 else 1.0  # a preempted pass
        n = rng.choice([1, 1, 2, 3, 4, 5, 8, 9, 12, 17, 24, 33])
        seconds = true_seconds(n) * load * spike * math.exp(rng.gauss(0, noise))
        now += seconds
        cost.observe(n, 200, seconds, now=now)


def test_the_shape_is_learned_under_a_wandering_load():
    cost = LearnedCost(SHIPPED_LIKE)
    assert cost(16, 128) / cost(1, 128) < 2.0  # the prior: flat-ish
    busy_passes(cost, STEEP)
    for n in (4, 8, 16, 32):
        assert cost.shape(n, 200) == pytest.approx(STEEP(n) / STEEP(1), rel=0.25), n


def test_the_curve_used_is_always_believable():
    cost = LearnedCost(SHIPPED_LIKE)
    rng = random.Random(1)
    for _ in range(500):  # nonsense timings: large passes cheaper than small ones, huge swings
        n = rng.choice([1, 4, 16, 32])
        cost.observe(n, 128, rng.uniform(0.001, 5.0) / n, now=0.0)
    shape = [cost.shape(n, 128) for n in SIZES]
    assert shape[0] == 1.0
    assert all(b >= a for a, b in zip(shape, shape[1:]))  # monotone
    assert all(s <= n + 1e-9 for s, n in zip(shape, SIZES))  # n tokens at most n one-token passes


def test_passes_far_apart_or_of_other_tags_are_not_compared():
    cost = LearnedCost(SHIPPED_LIKE)
    before = cost.shape(16, 128)
    for i in range(100):  # a 16-token pass after a long idle gap looks 10x dearer: not learned
        cost.observe(1, 128, 0.03, now=10.0 * i)
        cost.observe(16, 128, 0.3, now=10.0 * i + 5.0)
    for _ in range(100):  # nor a pass on another thread count
        cost.observe(1, 128, 0.03, tag=2, now=0.0)
        cost.observe(16, 128, 0.3, tag=1, now=0.0)
    assert cost.shape(16, 128) == pytest.approx(before)


def test_the_state_round_trips_and_a_bad_one_is_refused():
    cost = LearnedCost(SHIPPED_LIKE)
    busy_passes(cost, STEEP, passes=200)
    state = json.loads(json.dumps(cost.state()))
    again = LearnedCost(SHIPPED_LIKE, state=state)
    assert [again.shape(n, 300) for n in SIZES] == pytest.approx([cost.shape(n, 300) for n in SIZES])
    assert again.passes == cost.passes
    for bad in ({**state, "g": [[float("nan")] * len(SIZES)] * 2}, {**state, "sizes": [1, 2]}, {"version": 0}):
        with pytest.raises((ValueError, KeyError)):
            LearnedCost(SHIPPED_LIKE, state=bad)


def test_the_log_says_when_the_curve_changes():
    said = []
    cost = LearnedCost(SHIPPED_LIKE, said.append)
    busy_passes(cost, STEEP)
    assert any("forward-pass cost learned from" in m for m in said)
    said.clear()
    busy_passes(cost, STEEP, seed=2)  # the same machine again: nothing new to say
    assert not said


def test_the_guard_caps_drafts_that_do_not_pay_then_probes_again():
    said = []
    cost = LearnedCost(SHIPPED_LIKE, said.append)
    one = 0.05
    caps = []
    for _ in range(5 * 12):  # drafts that cost 2-3 one-token passes and emit 1 token: losing
        cap = cost.max_draft()
        caps.append(cap)
        k = 8 if cap is None else min(8, cap)
        if k:
            cost.observe_step(1 + k, 128, (1 + k / 4) * one, (1 + k / 4) * one, 1)
    assert caps[0] is None and 4 in caps and 2 in caps  # halved at each losing window
    assert cost.max_draft() == 0 and "decoding plainly" in said[-1]
    for _ in range(40):  # plain steps until the probe
        cost.observe_step(1, 128, one, one, 1)
    assert cost.max_draft() == 2
    for _ in range(12):  # the probes pay: 3-token passes at 1.1x one token emit 3 tokens
        cost.observe_step(3, 128, 1.1 * one, 1.1 * one, 3)
    assert cost.max_draft() == 4 and "pay again" in said[-1]
    for _ in range(4 * 12):
        cost.observe_step(3, 128, 1.1 * one, 1.1 * one, 3)
    assert cost.max_draft() is None


def test_sane_worked_case():
    g = np.zeros((2, len(SIZES)))
    g[0, 1:4] = [0.5, 0.2, 9.0]
    assert _sane(g)[0, :4].round(2).tolist() == [0.0, 0.5, 0.5, 2.08]


@pytest.mark.parametrize("busy", [True, False])
def test_the_thread_tuner_follows_the_load(busy):
    applied, said = [], []
    tuner = ThreadTuner((2, 1), applied.append, said.append)
    rng = random.Random(0)
    total = 0.0
    for _ in range(300):
        t = tuner.before_pass()
        seconds = (0.3 if t == 2 else 0.03) if busy else (0.05 if t == 2 else 0.07)
        seconds *= math.exp(rng.gauss(0, 0.1))
        total += seconds
        tuner.after_pass(t, seconds)
    assert tuner.current == (1 if busy else 2)
    assert applied[-1] in (1, 2) and len(applied) == 300
    best = 300 * (0.03 if busy else 0.05)
    assert total < (1.2 if busy else 1.05) * best  # the probes cost little
    assert bool(said) == busy


def test_the_thread_tuner_switches_back_when_the_load_goes():
    tuner = ThreadTuner((2, 1))
    for i in range(2000):
        busy = i < 600
        t = tuner.before_pass()
        tuner.after_pass(t, (0.3 if t == 2 else 0.03) if busy else (0.05 if t == 2 else 0.07))
        if i == 599:
            assert tuner.current == 1
    assert tuner.current == 2


def test_generation_with_a_learned_cost_and_thread_tuning_stays_lossless():
    """The real decode loop with a tiny model: the learned cost and the guard cut drafts, the tuner
    switches threads between passes (forced here by a tuner that always probes), and the output
    equals plain greedy decoding token for token."""
    import torch

    from specx.core.decode.generate import generate, greedy_decode, set_threads, thread_tuner
    from test_generate import FakeDrafter, all_right, deep_chain, wide_tree
    from test_verify import tiny_model

    model = tiny_model()
    threads = torch.get_num_threads()
    applied = []
    tuner = ThreadTuner((threads, 1), lambda n: (applied.append(n), set_threads(n)))
    tuner._wait = 0  # probe at every pass: both thread counts run
    rng = random.Random(5)
    cost = LearnedCost(SHIPPED_LIKE)
    try:
        for trial in range(4):
            prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(2, 12))]
            reference = greedy_decode(model, prompt, 24)
            for make in (all_right, deep_chain, wide_tree):
                out = [t for s in generate(model, prompt, FakeDrafter(make, reference), max_new_tokens=24, cost=cost,
                                           threads=tuner) for t in s.new_tokens]
                assert out == reference
    finally:
        set_threads(threads)
    assert cost.passes > 0 and (threads == 1 or {threads, 1} <= set(applied))
    assert thread_tuner(model) is None or thread_tuner(model).candidates == [threads, 1]


def test_a_linear_curve_is_learned_from_drafted_passes_and_the_anchors_they_leave():
    """llama.cpp's curve on this CPU: n tokens cost nearly n one-token passes (measured: 8 tokens
    5.8x, here n ** 0.9). Passes sized as drafts are
    (mostly 4 to 12 tokens), with the one-token passes that max_draft asks for now and then: the
    small sizes, which few pairs reach, are not pushed down to make room above them (they were,
    when every pair moved both of its cells: 2 tokens came out cheaper than one)."""
    rng = random.Random(3)
    cost, load, now = LearnedCost(SHIPPED_LIKE), 1.0, 0.0
    for _ in range(1200):
        load = min(max(load * math.exp(rng.gauss(0, 0.1)), 0.5), 4.0)
        n = 1 if cost.max_draft() == 0 else rng.choice([2, 3, 4, 5, 6, 8, 9, 12])
        seconds = 0.015 * n ** 0.9 * load * math.exp(rng.gauss(0, 0.05))
        now += seconds
        cost.observe(n, 400, seconds, now=now)
    for n in (2, 4, 8):
        assert cost.shape(n, 400) == pytest.approx(n ** 0.9, rel=0.25), n
    assert cost.anchors >= 16


def test_the_guard_believes_plain_steps_measured_a_moment_ago_over_a_curve_that_flatters_drafts():
    """A curve that says 4 tokens cost what one does (a prior not yet corrected), on an engine
    where they cost 3x: the passes alone would call 2-token-per-step drafts a win; the plain steps
    between them say they lose, and the guard caps them."""
    cost = LearnedCost(ForwardCost((1, 4, 64), (0.01, 0.01, 0.01)))
    for _ in range(4):
        cost.observe_step(1, 300, 0.010, 0.010, 1)  # plain steps: 10 ms a token
        for _ in range(GUARD_STEPS):
            cost.observe_step(4, 300, 0.030, 0.030, 2)  # drafted: 15 ms a token
    assert cost.cap is not None and cost.cap < 4
