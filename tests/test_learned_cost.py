"""The forward-pass cost learned from the passes (core.cost: the curve, the guard, the two as one learned
cost kept in a file) and the thread count chosen
from them (core.model.threads): simulated passes with a known cost and a load that changes, so that
nothing here depends on this machine's timing."""

import json
import math
import os
import random
import threading

import numpy as np
import pytest

from specx.core.cost.curve import SIZES, LearnedCurve, _sane
from specx.core.cost.forward import ForwardCost
from specx.core.cost.guard import GUARD_STEPS, DraftGuard
from specx.core.cost.learned import LearnedCost
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
    cost = LearnedCurve(SHIPPED_LIKE)
    assert cost(16, 128) / cost(1, 128) < 2.0  # the prior: flat-ish
    busy_passes(cost, STEEP)
    for n in (4, 8, 16, 32):
        assert cost.shape(n, 200) == pytest.approx(STEEP(n) / STEEP(1), rel=0.25), n


def test_each_context_learns_its_own_shape():
    """Drafted rows cost little after a short prompt and much after a long conversation (or the
    other way round, by engine): passes at 200 and at 8,000 cached tokens teach their own cells,
    and a context between them reads both."""
    cost = LearnedCurve(SHIPPED_LIKE)
    short, long = (lambda n: 0.02 * (1 + 0.05 * (n - 1))), (lambda n: 0.05 * (1 + 0.5 * (n - 1)))
    rng = random.Random(3)
    now = 0.0
    for _ in range(1500):
        context, true = (200, short) if rng.random() < 0.5 else (8000, long)
        for n in (1, rng.choice([2, 4, 8])):  # a plain pass, then a drafted one beside it
            now += true(n)
            cost.observe(n, context, true(n) * math.exp(rng.gauss(0, 0.05)), now=now)
    assert cost.shape(4, 200) == pytest.approx(short(4) / short(1), rel=0.15)
    assert cost.shape(4, 8000) == pytest.approx(long(4) / long(1), rel=0.15)
    assert cost.shape(4, 200) < cost.shape(4, 4000) < cost.shape(4, 8000)


def test_the_curve_used_is_always_believable():
    cost = LearnedCurve(SHIPPED_LIKE)
    rng = random.Random(1)
    for _ in range(500):  # nonsense timings: large passes cheaper than small ones, huge swings
        n = rng.choice([1, 4, 16, 32])
        cost.observe(n, 128, rng.uniform(0.001, 5.0) / n, now=0.0)
    shape = [cost.shape(n, 128) for n in SIZES]
    assert shape[0] == 1.0
    assert all(b >= a for a, b in zip(shape, shape[1:]))  # monotone
    assert all(s <= n + 1e-9 for s, n in zip(shape, SIZES))  # n tokens at most n one-token passes


def test_passes_far_apart_or_of_other_tags_are_not_compared():
    cost = LearnedCurve(SHIPPED_LIKE)
    before = cost.shape(16, 128)
    for i in range(100):  # a 16-token pass after a long idle gap looks 10x dearer: not learned
        cost.observe(1, 128, 0.03, now=10.0 * i)
        cost.observe(16, 128, 0.3, now=10.0 * i + 5.0)
    for _ in range(100):  # nor a pass on another thread count
        cost.observe(1, 128, 0.03, tag=2, now=0.0)
        cost.observe(16, 128, 0.3, tag=1, now=0.0)
    assert cost.shape(16, 128) == pytest.approx(before)


def test_the_state_round_trips_and_a_bad_one_is_refused():
    cost = LearnedCurve(SHIPPED_LIKE)
    busy_passes(cost, STEEP, passes=200)
    state = json.loads(json.dumps(cost.state()))
    again = LearnedCurve(SHIPPED_LIKE, state=state)
    assert [again.shape(n, 300) for n in SIZES] == pytest.approx([cost.shape(n, 300) for n in SIZES])
    assert again.passes == cost.passes
    for bad in ({**state, "g": [[float("nan")] * len(SIZES)] * 2}, {**state, "sizes": [1, 2]}, {"version": 0}):
        with pytest.raises((ValueError, KeyError)):
            LearnedCurve(SHIPPED_LIKE, state=bad)


def test_the_log_says_when_the_curve_changes():
    said = []
    cost = LearnedCurve(SHIPPED_LIKE, say=said.append)
    busy_passes(cost, STEEP)
    assert any("forward-pass cost learned from" in m for m in said)
    said.clear()
    busy_passes(cost, STEEP, seed=2)  # the same machine again: nothing new to say
    assert not said


def test_the_guard_caps_drafts_that_do_not_pay_then_probes_again():
    said = []
    cost = LearnedCost(SHIPPED_LIKE, say=said.append)
    one = 0.05
    caps = []

    def step(n, seconds, num_out):  # what the guard hears of a step (its curve learns nothing here)
        cost.guard.observe_step(num_tokens=n, context=128, verify_seconds=seconds, step_seconds=seconds,
                                num_out=num_out)

    for _ in range(5 * 12):  # drafts that cost 2-3 one-token passes and emit 1 token: losing
        cap = cost.max_draft()
        caps.append(cap)
        k = 8 if cap is None else min(8, cap)
        if k:
            step(1 + k, (1 + k / 4) * one, 1)
    assert caps[0] is None and 4 in caps and 2 in caps  # halved at each losing window
    assert cost.max_draft() == 0 and "decoding plainly" in said[-1]
    for _ in range(40):  # plain steps until the probe
        step(1, one, 1)
    assert cost.max_draft() == 2
    for _ in range(12):  # the probes pay: 3-token passes at 1.1x one token emit 3 tokens
        step(3, 1.1 * one, 3)
    assert cost.max_draft() == 4 and "pay again" in said[-1]
    for _ in range(4 * 12):
        step(3, 1.1 * one, 3)
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
    """The real decode loop with a tiny model: the learned cost and the guard cut drafts, the
    engine's tuner switches threads between passes (forced here: it probes at every pass), each
    step's timing is tagged with its pass's thread count, and the output equals plain greedy
    decoding token for token."""
    import torch

    from specx.core.decode.generate import generate, greedy_decode
    from specx.core.decode.request import Decoding
    from specx.core.model.transformers.engine import TransformersEngine
    from specx.core.model.threads import set_threads
    from helpers.decoding import FakeDrafter, all_right, deep_chain, wide_tree
    from helpers.models import tiny_model

    model = tiny_model()
    engine = TransformersEngine(model)
    assert engine.tuner is None  # nothing is tuned until asked
    threads = torch.get_num_threads()
    rng = random.Random(5)
    cost = LearnedCost(SHIPPED_LIKE)
    tuner = engine.tune_threads(cost.shape)
    if threads > 1:
        assert engine.tune_threads() is tuner and tuner.candidates == [threads, 1] and tuner.shape == cost.shape
        applied, tags = [], []
        tuner.apply = lambda n: (applied.append(n), set_threads(n))
        tuner._wait = 0  # probe at every pass: both thread counts run
        observe = cost.observe_step
        cost.observe_step = lambda **step: (tags.append(step["tag"]), observe(**step))
    else:
        assert tuner is None
    try:
        for trial in range(4):
            prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(2, 12))]
            reference = greedy_decode(model, prompt, 24)
            for make in (all_right, deep_chain, wide_tree):
                out = [t for s in generate(engine, prompt, FakeDrafter(make, reference), Decoding(max_new_tokens=24),
                                           cost=cost) for t in s.new_tokens]
                assert out == reference
    finally:
        set_threads(threads)
    assert cost.passes > 0
    if threads > 1:
        assert {threads, 1} <= set(applied) and set(tags) == {threads, 1} and tuner.last in (threads, 1)


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
        cost.curve.observe(n, 400, seconds, now=now)
    for n in (2, 4, 8):
        assert cost.shape(n, 400) == pytest.approx(n ** 0.9, rel=0.25), n
    assert cost.curve.anchors >= 16


def test_the_guard_believes_plain_steps_measured_a_moment_ago_over_a_curve_that_flatters_drafts():
    """A curve that says 4 tokens cost what one does (a prior not yet corrected), on an engine
    where they cost 3x: the passes alone would call 2-token-per-step drafts a win; the plain steps
    between them say they lose, and the guard caps them."""
    curve = LearnedCurve(ForwardCost((1, 4, 64), (0.01, 0.01, 0.01)))
    guard = DraftGuard(curve.shape)
    for _ in range(4):
        guard.observe_step(num_tokens=1, context=300, verify_seconds=0.010, step_seconds=0.010,
                           num_out=1)  # plain steps: 10 ms a token
        for _ in range(GUARD_STEPS):
            guard.observe_step(num_tokens=4, context=300, verify_seconds=0.030, step_seconds=0.030,
                               num_out=2)  # drafted: 15 ms a token
    assert guard.cap is not None and guard.cap < 4


# --------------------------------------------------------------------------- the kept file (issue 39)

def _learned_state() -> dict:
    cost = LearnedCurve(SHIPPED_LIKE)
    busy_passes(cost, STEEP, passes=100)
    return json.loads(json.dumps(cost.state()))


def test_a_kept_state_no_machine_gives_is_refused_with_a_value_error():
    """Issue 39, cases 2-3: a state of the wrong type, counts past a float, or a load far outside
    any machine's (exp(-1e6) seconds made every request 500 with ZeroDivisionError) is refused as
    ValueError, never accepted or raised as something the caller does not expect."""
    state = _learned_state()
    bad = [[1, 2], "state", {**state, "passes": float("inf")}, {**state, "passes": -3}, {**state, "anchors": True},
           {**state, "passes": 10 ** 400}, {**state, "load": -1e6}, {**state, "load": 1e6}, {**state, "load": "0"},
           {**state, "g": [[1e300] * len(SIZES)] * 2}, {**state, "counts": [["x"] * len(SIZES)] * 2},
           {**state, "sizes": 7}, {**state, "contexts": None}, {k: v for k, v in state.items() if k != "g"}]
    for value in bad:
        with pytest.raises(ValueError):
            LearnedCurve(SHIPPED_LIKE, state=value)
    # the edges of the believable: a one-token pass of 1e-7 s and of 1000 s
    for load in (math.log(1e-7) + 1e-9, math.log(1e3) - 1e-9):
        assert LearnedCurve(SHIPPED_LIKE, state={**state, "load": load})(1, 128) > 0


def _deep_brackets(path, good):
    path.write_text("[" * 100_000)


def _passes_past_a_float(path, good):
    path.write_text(json.dumps(good).replace(f'"passes": {good["state"]["passes"]}', '"passes": 1e400'))


DAMAGED = {  # how a kept cost file can be damaged, and how to damage it
    "a list as its state": lambda path, good: path.write_text(json.dumps({**good, "state": [1, 2]})),
    "passes past a float": _passes_past_a_float,
    "100k brackets": _deep_brackets,
    "a load of -1e6": lambda path, good: path.write_text(
        json.dumps({**good, "state": {**good["state"], "load": -1e6}})),
    "more than a MiB": lambda path, good: path.write_text(json.dumps(good) + " " * (1 << 20)),
    "a symlink to /dev/zero": lambda path, good: path.symlink_to("/dev/zero"),
    "a FIFO": lambda path, good: os.mkfifo(path),
    "a directory": lambda path, good: path.mkdir(),
}


def _model_cost(net, said, timeout=60.0):
    """specx.home.model_cost in a thread that must end within `timeout` s (a FIFO once hung it)."""
    from specx.home import model_cost

    out = []
    thread = threading.Thread(target=lambda: out.append(model_cost(net, "tiny", said.append)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "model_cost did not return: it is reading a kept file that never ends"
    assert out, "model_cost raised (see the thread's traceback above)"
    return out[0]


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_kept_cost_file_that_cannot_be_used_is_set_aside_and_the_start_goes_on(damage, tmp_path, monkeypatch):
    """Issue 39, cases 2-4: whatever stands where the learned cost is kept, a start goes on from
    the shipped curve, sets the thing aside under a name that says so (one line naming it and
    why), and the next keep writes a good file in its place."""
    from specx.home import keep_cost
    from specx.core.model.transformers.engine import TransformersEngine
    from helpers.models import tiny_model

    monkeypatch.setenv("SPECX_HOME", str(tmp_path))
    net = TransformersEngine(tiny_model())
    said: list[str] = []
    cost = _model_cost(net, said)
    busy_passes(cost.curve, STEEP, passes=100)
    keep_cost(cost)
    path = cost.kept_at
    good = json.loads(path.read_text())
    assert _model_cost(net, said).passes == cost.passes  # a good file is used
    path.unlink()
    DAMAGED[damage](path, good)
    said.clear()
    again = _model_cost(net, said)
    assert again.passes == 0 and again(1, 128) > 0  # the shipped curve's shape
    assert not os.path.lexists(path)
    aside = list(path.parent.glob(f"{path.name}.unusable-*"))
    assert len(aside) == 1, list(path.parent.iterdir())
    mentions = [line for line in said if str(path) in line]
    assert len(mentions) == 1 and "cannot use" in mentions[0] and aside[0].name in mentions[0], said
    assert "\n" not in mentions[0] and len(mentions[0]) < 400
    if damage == "a symlink to /dev/zero":
        assert aside[0].is_symlink()  # the link was set aside, not its target
    busy_passes(again.curve, STEEP, passes=20)
    keep_cost(again)
    assert _model_cost(net, said).passes == again.passes
    assert not list(path.parent.glob("*.tmp"))


def test_keep_cost_leaves_no_temporary_file_when_it_cannot_write(tmp_path, monkeypatch):
    """Issue 39, case 2: a directory where the cost is kept left a learned-*.PID.tmp behind."""
    from specx.home import keep_cost
    from specx.core.model.transformers.engine import TransformersEngine
    from helpers.models import tiny_model

    monkeypatch.setenv("SPECX_HOME", str(tmp_path))
    cost = _model_cost(TransformersEngine(tiny_model()), [])
    busy_passes(cost.curve, STEEP, passes=20)
    cost.kept_at.parent.mkdir(parents=True, exist_ok=True)
    cost.kept_at.mkdir()
    said: list[str] = []
    keep_cost(cost, said.append)
    assert len(said) == 1 and "cannot keep" in said[0]
    assert sorted(p.name for p in cost.kept_at.parent.iterdir()) == [cost.kept_at.name]


def test_a_kept_file_is_read_with_a_bound_and_never_from_a_device_or_fifo(tmp_path):
    from specx.core.kept import Unusable, check_kept, check_kept_folder, read_kept, read_kept_json

    assert read_kept(tmp_path / "none") is None and not check_kept(tmp_path / "none")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert read_kept_json(tmp_path / "dangling") is None
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_kept_json(tmp_path / "ok.json") == {"a": 1}
    (tmp_path / "big").write_bytes(b"x" * 101)
    assert read_kept(tmp_path / "big", max_bytes=101) == b"x" * 101
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for name, why in (("big", "more than"), ("fifo", "FIFO"), ("zero", "character device"), (".", "directory")):
        with pytest.raises(Unusable, match=why):
            read_kept(tmp_path / name, max_bytes=100)
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(b"{}" * 100)
    (folder / "config.json").write_text("{}")
    assert check_kept_folder(folder, max_bytes=100, limits={"tokenizer.json": 200})
    assert not check_kept_folder(tmp_path / "none")
    with pytest.raises(Unusable, match="its tokenizer.json is 200 bytes"):
        check_kept_folder(folder, max_bytes=100)
    os.mkfifo(folder / "special_tokens_map.json")
    with pytest.raises(Unusable, match="its special_tokens_map.json is a FIFO"):
        check_kept_folder(folder, max_bytes=100, limits={"tokenizer.json": 200})
    with pytest.raises(Unusable, match="a file, not a folder"):
        check_kept_folder(tmp_path / "ok.json")
    for text, why in (("[" * 100_000, "too deep"), ("{", "not JSON"), (b"\xff", "UTF-8")):
        (tmp_path / "bad").write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(Unusable, match=why):
            read_kept_json(tmp_path / "bad")


def test_a_poisoned_kept_curve_is_forgotten_within_a_few_dozen_passes():
    """Issue 39, case 8: a kept curve whose cells say drafts are free (g all zeros, learned from
    thousands of pairs) on llama.cpp's steep curve (n tokens ~n ** 0.9 one-token passes). At the
    learning floor it would take far more passes to move; the passes contradict it pair after
    pair, so it is forgotten and learned again from the prior's shape."""
    steep_prior = ForwardCost((1, 2, 4, 8, 16, 32), tuple(0.015 * n ** 0.9 for n in (1, 2, 4, 8, 16, 32)))
    truth = LearnedCurve(steep_prior)
    poisoned = truth.state() | {"g": np.zeros_like(truth.g).tolist(), "counts": np.full_like(truth.g, 5000).tolist(),
                                "anchors": 500, "passes": 50000}
    said = []
    cost = LearnedCurve(steep_prior, say=said.append, state=poisoned)
    assert cost.shape(8, 400) == pytest.approx(1.0)  # drafts look free
    rng, now = random.Random(5), 0.0
    for _ in range(48):  # a few dozen passes as drafts come: sizes vary
        n = rng.choice([1, 2, 4, 6, 8, 12])
        seconds = 0.015 * n ** 0.9 * math.exp(rng.gauss(0, 0.05))
        now += seconds
        cost.observe(n, 400, seconds, now=now)
    assert any("contradict the curve" in line for line in said)
    assert cost.shape(8, 400) == pytest.approx(8 ** 0.9, rel=0.3)


def test_a_right_curve_under_noise_is_never_forgotten():
    """The contradiction check does not fire on a busy machine's noise: a learned, right curve stays."""
    said = []
    cost = LearnedCurve(SHIPPED_LIKE, say=said.append)
    busy_passes(cost, STEEP, passes=3000, seed=11)
    assert not any("contradict" in line for line in said)
    assert cost.shape(16, 200) == pytest.approx(STEEP(16) / STEEP(1), rel=0.35)
