"""The predictor (core/predict/estimate.py): hand-worked estimates and curves, sampled replay == full replay
on a real store, and the commands' prediction, projection and bad input."""

import json
import math

import numpy as np
import pytest

from helpers.cli import AGENT_DATA, specx_in_process
from specx.core.cost.forward import ForwardCost
from specx.core.cost.shipped import FOLDER
from specx.core.predict.curves import CostCurve, PredictError, builtin_curves, load_cost_curve
from specx.core.predict.estimate import learning_curve, predict, predict_groups, projected_speedup, replay_sample
from specx.core.decode.speculate import PromptLookupDrafter, SuffixDrafter
from specx.core.predict.replay import replay
from specx.core.predict.sampling import Sample, SampleError, allocate, draw_sample, draw_stratified, ratio_estimate, systematic_sample

from helpers.logs import good_logs


def arr(*tokens):
    return np.array(tokens, dtype=np.int32)


# ------------------------------------------------------------------------------- estimates, by hand


def test_ratio_estimator_and_interval_by_hand():
    # Three calls sampled of six: tokens 4, 6, 10 in steps 2, 2, 4. r = 20 / 8 = 2.5; residuals
    # y - r x = -1, 1, 0 (sum of squares 2, / (n - 1) = 1); xbar = 8/3; fpc = 1 - 3/6 = 1/2:
    # se^2 = 0.5 / (3 * 64/9) * 1 = 3/128, se = 0.15309; interval 2.5 -+ 1.96 se = 2.200 .. 2.800.
    e = ratio_estimate([4, 6, 10], [2, 2, 4], population=6)
    assert e.value == 2.5
    assert e.se == pytest.approx(math.sqrt(3 / 128))
    assert (e.low, e.high) == pytest.approx((2.5 - 1.959964 * 0.153093, 2.5 + 1.959964 * 0.153093), abs=1e-5)
    # Drawn with unequal chances (no finite-population correction): se^2 = 1 / (3 * 64/9) = 3/64.
    assert ratio_estimate([4, 6, 10], [2, 2, 4], population=None).se == pytest.approx(math.sqrt(3 / 64))
    # The whole population: the exact ratio, no width; one unit of many: no standard error.
    whole = ratio_estimate([4, 6, 10], [2, 2, 4], population=3)
    assert (whole.value, whole.se, whole.low, whole.high) == (2.5, 0.0, 2.5, 2.5)
    one = ratio_estimate([4], [2], population=6)
    assert (one.value, one.se, one.low) == (2.0, None, None)
    assert ratio_estimate([], [], population=6).value is None
    with pytest.raises(SampleError):
        ratio_estimate([1, 2], [1, 1], population=1)


def test_systematic_draws_by_hand():
    assert systematic_sample([1] * 10, 4, seed=None) == [1, 3, 6, 8]  # every 2.5, from 1.25
    # Sizes 1, 9, 1, 1 (total 12), 4 points at 1.5, 4.5, 7.5, 10.5: the long call three times.
    assert systematic_sample([1, 9, 1, 1], 4, seed=None) == [1, 1, 1, 2]
    # Each call is drawn n * size / total times on average over the random start.
    counts = np.zeros(4)
    for seed in range(4000):
        for i in systematic_sample([1, 9, 1, 1], 4, seed=seed):
            counts[i] += 1
    assert counts / 4000 == pytest.approx([4 / 12, 36 / 12, 4 / 12, 4 / 12], abs=0.03)
    with pytest.raises(SampleError):
        systematic_sample([1, 1], 0)


def test_draw_sample_weights_and_the_whole_selection():
    lengths = [4, 100, 9, 16, 1, 25]
    whole = draw_sample(lengths, 6)
    assert whole.exhaustive and whole.hits == tuple(range(6)) and set(whole.weights) == {1.0}
    by_calls = draw_sample(lengths, 3, seed=None, power=0)
    # expansion weights: 1 / (a call's expected draws), 6 / 3 for each of 3 draws among 6 alike
    assert by_calls.hits == (1, 3, 5) and by_calls.population == 6 and set(by_calls.weights) == {2.0}
    weighted = draw_sample(lengths, 3, seed=None)  # sizes 2, 10, 3, 4, 1, 5 (25): points 4.17, 12.5, 20.8
    assert weighted.hits == (1, 2, 5) and weighted.population is None
    assert weighted.weights == pytest.approx((25 / 3 / 10, 25 / 3 / 3, 25 / 3 / 5))  # total / (n size)
    assert weighted.calls == [1, 2, 5]


def test_cost_curve_interpolation():
    # The shipped CPU curve: its file's points divided by the 1-token cost, linear in between, and
    # past the last point the slope of the last two.
    points = {int(k): v for k, v in json.loads((FOLDER / "cpu.json").read_text())["cost"].items()}
    cpu = builtin_curves()["cpu"]
    assert cpu(1) == 1.0
    for k, v in points.items():
        assert cpu(k) == pytest.approx(v / points[1])
    a, b = sorted(points)[-2:]
    assert cpu(2 * b - a) == pytest.approx((2 * points[b] - points[a]) / points[1])
    assert not cpu.flat(33) and "specx bench cost" in cpu.about
    mid = CostCurve.from_mapping("c", {"1": 2.0, "5": 4.0})
    assert mid(3) == pytest.approx(1.5)  # halfway from 1.0 to 2.0
    flat = builtin_curves()["flat"]
    assert flat.flat(64) and flat(33) == 1.0
    assert CostCurve.from_mapping("one", {"1": 3}).flat(100)
    assert CostCurve("f", ForwardCost((1, 2), (1.0, 1.5)))(2) == 1.5


def test_cost_curve_files(tmp_path):
    good = tmp_path / "gpu.json"
    good.write_text(json.dumps({"1": 10, "16": 11, "64": 14}))
    curve = load_cost_curve(good)
    assert curve.name == "gpu" and curve(16) == pytest.approx(1.1) and curve(40) == pytest.approx(1.25)
    (tmp_path / "about.json").write_text(json.dumps({"about": "measured", "cost": {"1": 1, "2": 1.5}}))
    assert load_cost_curve(tmp_path / "about.json").about == "measured"
    bad = {
        "not JSON": ("{1: 2", "not JSON (line 1"),
        "a list": ("[1, 2]", "expected a JSON object"),
        "empty": ("{}", "expected a JSON object"),
        "a bad key": ('{"1": 1, "k": 2}', "key 'k' is not a number of tokens"),
        "zero tokens": ('{"0": 1, "1": 1}', "key '0' is not a number"),
        "a negative cost": ('{"1": 1, "4": -2}', "'4' must be a positive number, got -2"),
        "a string cost": ('{"1": "fast"}', "'1' must be a positive number"),
        "a boolean": ('{"1": true}', "'1' must be a positive number"),
        "no 1": ('{"2": 1, "4": 2}', 'needs "1"'),
        "twice": ('{"1": 1, " 1": 2}', "given twice"),
        "unknown field": ('{"cost": {"1": 1}, "source": "x"}', "unknown field 'source'"),
    }
    for what, (text, message) in bad.items():
        path = tmp_path / "bad.json"
        path.write_text(text)
        with pytest.raises(PredictError, match="cost curve .*bad.json: ") as info:
            load_cost_curve(path)
        assert message in str(info.value), what
    with pytest.raises(PredictError, match="cannot be read"):
        load_cost_curve(tmp_path / "missing.json")


def test_speedup_on_a_hand_made_call():
    # core/predict/replay.py's hand-worked call: the history [7, 8, 9], prompt [1], output [7, 8, 9, 5]:
    # specx takes 3 steps with drafts of 0, 1 and 0 tokens; prompt lookup finds nothing in [1, 7, ...]
    # that repeats: 4 steps, no drafts. On a curve where 2 tokens cost 1.5 (the one-node draft pays:
    # 2 tokens expected for 1.5, so sizing keeps it), specx's passes cost 1 + 1.5 + 1 = 3.5, plain
    # decoding 4 x 1, prompt lookup 4 x 1: 4 / 3.5 over plain and over prompt lookup; on the flat
    # curve 4 / 3 over both.
    steep = CostCurve("steep", ForwardCost((1, 2), (1.0, 1.5)))
    flat = builtin_curves()["flat"]
    outputs = [arr(7, 8, 9), arr(7, 8, 9, 5)]
    replayed = replay_sample(outputs, ["a", "a"], [1], [arr(1)], SuffixDrafter, make_prompt_lookup=PromptLookupDrafter,
                             curves=[steep, flat])
    (call,) = replayed
    assert (call.index, call.history_tokens, call.stats.tokens, call.stats.steps) == (1, 3, 4, 3)
    assert call.costs == {"steep": (4.0, 3.5, 4.0), "flat": (4.0, 3.0, 4.0)}
    assert call.prompt_lookup_steps == 4
    projected = projected_speedup(replayed, ["steep", "flat"])
    assert projected["steep"] == pytest.approx({"vs_plain": 4 / 3.5, "vs_prompt_lookup": 4 / 3.5})
    assert projected["flat"] == pytest.approx({"vs_plain": 4 / 3, "vs_prompt_lookup": 4 / 3})
    sample = Sample((1,), (1.0,), 1, exhaustive=True)
    prediction = predict(sample, {1: call}, 1, ["steep"])
    assert prediction.tokens_per_step.value == pytest.approx(4 / 3) and prediction.tokens_per_step.se == 0
    assert prediction.speedup["steep"]["vs_plain"].value == pytest.approx(4 / 3.5)
    # A prefill costing 6 one-token passes is paid by every method: (6 + 4) / (6 + 3.5) on the steep curve.
    with_prefill = replay_sample(outputs, ["a", "a"], [1], [arr(1)], SuffixDrafter,
                                 make_prompt_lookup=PromptLookupDrafter, curves=[steep], prefill=[6.0])
    assert with_prefill[0].costs == {"steep": (10.0, 9.5, 10.0)}
    # Without its history the call drafts nothing: 4 steps.
    alone = replay_sample(outputs[1:], ["a"], [0], [arr(1)], SuffixDrafter)
    assert alone[0].stats.steps == 4 and alone[0].history_tokens == 0


def test_weighted_draws_estimate_the_ratio():
    # Two calls drawn of four (chances ~ sqrt(length)): the estimate weights each by 1 / sqrt(length).
    # Lengths 4 and 16 (weights 1/2, 1/4), steps 2 and 4: (2 + 4) / (1 + 1) = 3 tokens per step.
    calls = {0: _call(0, "a", 4, 2), 2: _call(2, "a", 16, 4)}
    sample = Sample((0, 2), (0.5, 0.25), None)
    overall, groups = predict_groups({"a": sample}, list(calls.values()), {"a": 4})
    assert overall.tokens_per_step.value == pytest.approx(3.0) and overall.sample_calls == 2
    # Weighted units y = (2, 4), x = (1, 1): residuals -1, 1; se^2 = 1 / (2 * 1^2) * 2 / 1 = 1.
    assert overall.tokens_per_step.se == pytest.approx(1.0) == groups["a"].tokens_per_step.se
    assert groups["a"].to_json()["predicted_tokens_per_step"] == 3.0
    # The learning curve weighs calls as the estimate does: its point over the whole sample is the estimate.
    assert learning_curve(list(calls.values()), sample, window=2) == [(0, 2.0), (0, 3.0)]


def test_groups_drawn_apart_and_combined():
    # Group a (2 calls) taken whole: 10 tokens in 4 steps, exactly 2.5. Group b: 2 of its 4 calls,
    # every call alike (expansion weight 2): 8 and 4 tokens in 2 steps each, so 24 / 8 = 3.0 with
    # se^2 = (1 - 2/4) / (2 * 4^2) * ((16 - 12)^2 + (8 - 12)^2) = 0.5. Overall, the combined ratio
    # (10 + 24) / (4 + 8), se^2 = 0.5 * 2 * ((4.67 - 0.67)^2 + (-3.33 - 0.67)^2) / 12^2 = 32 / 144.
    calls = [_call(0, "a", 4, 2), _call(1, "a", 6, 2), _call(2, "b", 8, 2), _call(5, "b", 4, 2)]
    samples = {"a": Sample((0, 1), (1.0, 1.0), 2, exhaustive=True), "b": Sample((2, 5), (2.0, 2.0), 4)}
    overall, groups = predict_groups(samples, calls, {"a": 2, "b": 4})
    assert (groups["a"].tokens_per_step.value, groups["a"].tokens_per_step.se) == (2.5, 0.0)
    assert groups["b"].tokens_per_step.value == 3.0 and groups["b"].tokens_per_step.se == pytest.approx(0.5 ** 0.5)
    assert overall.tokens_per_step.value == pytest.approx(34 / 12)
    assert overall.tokens_per_step.se == pytest.approx((32 / 144) ** 0.5)
    assert overall.calls == 6 and overall.sample_calls == 4
    # A stratified draw of n in all: a small group whole, the others what is left.
    parts = draw_stratified([1] * 10, list("aaaaaaaabb"), 4, seed=None, power=0)
    assert parts["b"].exhaustive and parts["b"].hits == (8, 9) and parts["a"].hits == (2, 6)
    assert all(p.exhaustive for p in draw_stratified([3, 1, 2], list("abb"), 3).values())


def test_allocate_spends_the_sample_and_no_more():
    # n = 20 over 4 groups: floor 5. "d" (3 calls) whole; of the 17 left, "b" and "c" would get
    # 17 * 1/12 = 1.4 by size, so each its floor of 5; "a" the remaining 7.
    draws = allocate({"a": 10.0, "b": 1.0, "c": 1.0, "d": 0.5}, {"a": 100, "b": 50, "c": 50, "d": 3}, 20)
    assert draws == {"a": 7, "b": 5, "c": 5, "d": 3}
    # Shares by size with largest remainders: 10 * (0.55, 0.45) = 5.5, 4.5 -> floors 5 each.
    assert allocate({"a": 55.0, "b": 45.0}, {"a": 100, "b": 100}, 10) == {"a": 5, "b": 5}
    assert allocate({"a": 56.0, "b": 44.0}, {"a": 100, "b": 100}, 11) == {"a": 6, "b": 5}
    rng = np.random.default_rng(0)
    for _ in range(200):  # never more than n draws (while 2 per group fit), every group drawn
        groups = int(rng.integers(1, 8))
        counts = {str(g): int(rng.integers(1, 300)) for g in range(groups)}
        measures = {g: float(rng.random() * c + 0.1) for g, c in counts.items()}
        n = int(rng.integers(2 * groups, 400))
        draws = allocate(measures, counts, n)
        assert sum(draws.values()) <= n and all(d >= min(2, counts[g]) for g, d in draws.items())


def _call(index, group, tokens, steps):
    from specx.core.decode.loop import DecodeStats
    from specx.core.predict.estimate import SampledCall

    return SampledCall(index, group, 0, DecodeStats(calls=1, tokens=tokens, steps=steps))


# ------------------------------------------------------------------- exact per call, on a real store


def _store_calls(tmp_path, tokenizer):  # noqa: F811
    from specx.store.db import Store
    from specx.store.ingest import ingest
    from specx.store.prompts import prompt_tokens
    from specx.store.selection import select_calls

    sources = [good_logs(tmp_path)]
    swe = AGENT_DATA / "swe-agent-multi-swe-bench-java" / "trajs" / "20240825_SWE-agent_gpt-4o-2024-05-13"
    if swe.is_dir():
        sources.append(swe)
    with Store(tmp_path / "real.db") as store:
        ingest(store, sources, tokenizer)
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        calls = select_calls(store, tok_id)
        prompts = prompt_tokens(store, tokenizer.get(), calls, 4096)
        outputs = [store.call_tokens(c.id, tok_id) for c in calls]
    return calls, prompts, outputs


def test_a_sampled_call_measures_what_the_full_replay_measures(tmp_path, tokenizer):  # noqa: F811
    from specx.predict import REPLAY_DEFAULTS
    from specx.core.predict.methods import make_drafter

    calls, prompts, outputs = _store_calls(tmp_path, tokenizer)
    assert len(calls) > 20
    # The full replay, each call its own group: per-call (tokens, steps, drafted, accepted).
    full = replay(((str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))),
                  make_drafter("specx", REPLAY_DEFAULTS))
    sample = draw_sample([len(o) for o in outputs], 12, seed=3)
    positions = sample.calls
    assert 0 < len(positions) < len(calls)
    steep = CostCurve("steep", ForwardCost((1, 8, 33), (1.0, 1.6, 3.0)))
    curves = [builtin_curves()["flat"], steep]
    specx = lambda: make_drafter("specx", REPLAY_DEFAULTS)  # noqa: E731
    lookup = lambda: make_drafter("prompt_lookup", REPLAY_DEFAULTS)  # noqa: E731
    sampled = replay_sample(outputs, ["g"] * len(calls), positions, [prompts[i] for i in positions], specx,
                            make_prompt_lookup=lookup, curves=curves)
    for call in sampled:
        want = full.groups[str(call.index)]
        got = call.stats
        assert (got.tokens, got.steps, got.drafted, got.accepted) == (want.tokens, want.steps, want.drafted,
                                                                      want.accepted), call.index
        assert call.history_tokens == sum(len(o) for o in outputs[: call.index])
    # The projection over every call (as `specx replay` computes it) gives the sampled calls the
    # same costs: drafts cut on the steep curve depend on nothing but the call and its history.
    everything = replay_sample(outputs, ["g"] * len(calls), list(range(len(calls))), prompts, specx,
                               make_prompt_lookup=lookup, curves=curves, unsized=False,
                               specx_steps=[s for _, s in full.curve])
    by_index = {c.index: c for c in everything}
    for call in sampled:
        assert by_index[call.index].costs == call.costs
        assert call.costs["flat"][1] == call.stats.steps  # flat: a pass costs one, nothing is cut


def test_prompts_tokenized_in_a_thread_from_a_snapshot_equal_prompt_tokens(tmp_path, tokenizer):  # noqa: F811
    """What the prediction's walk reads (PromptMessages read once, iter_prompt_tokens in small
    chunks, in a thread) is prompt_tokens' result, item for item, and the thread's error reaches
    the reader."""
    from specx.predict import Prefetched
    from specx.store.db import Store
    from specx.store.ingest import ingest
    from specx.store.prompts import iter_prompt_tokens, prompt_tokens
    from specx.store.selection import PromptMessages, select_calls

    with Store(tmp_path / "s.db") as store:
        ingest(store, [good_logs(tmp_path)], tokenizer)
        calls = select_calls(store, store.tokenizer_id(tokenizer.fingerprint))
        want = prompt_tokens(store, tokenizer.get(), calls, 64)
        snapshot = PromptMessages(store, calls)
    assert len(calls) > 5
    got = Prefetched(iter_prompt_tokens(snapshot, tokenizer.get(), calls, 64, chunk=3), len(calls))
    assert len(got) == len(calls)
    assert all(np.array_equal(got[j], w) for j, w in enumerate(want))

    def failing():
        yield 1
        raise ValueError("bad message")

    broken = Prefetched(failing(), 3)
    assert broken[0] == 1
    with pytest.raises(ValueError, match="bad message"):
        broken[1]


# ------------------------------------------------------------------------------------- the commands


def run(*args):
    return specx_in_process(*args)  # test_replay.py runs these commands as real processes


@pytest.fixture(scope="module")
def db(tmp_path_factory, tokenizer):  # noqa: F811
    tokenizer.get()
    root = tmp_path_factory.mktemp("predict-cli")
    path = str(root / "cli.db")
    assert run("ingest", str(good_logs(root)), "--db", path).returncode == 0
    return path


def test_entropy_predicts_what_replay_measures(db):
    from specx.predict import REPLAY_DEFAULTS

    replayed = run("replay", "--db", db, "--json", "--no-baselines")
    assert replayed.returncode == 0, replayed.stderr
    measured = json.loads(replayed.stdout)
    assert {k: measured["params"][k] for k in REPLAY_DEFAULTS} == REPLAY_DEFAULTS
    assert set(measured["projected_speedup"]) == {"flat", "cpu"}
    # A selection smaller than the sample is replayed whole: the prediction is the replay's figure.
    res = run("entropy", "--db", db, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    overall = data["overall"]
    assert overall["sample_calls"] == measured["overall"]["calls"] == overall["calls"]
    assert overall["predicted_tokens_per_step"] == pytest.approx(measured["overall"]["tokens_per_step"])
    assert overall["predicted_tokens_per_step_low"] == overall["predicted_tokens_per_step_high"]
    for curve in ("flat", "cpu"):
        for against in ("vs_plain", "vs_prompt_lookup"):
            assert overall["predicted_speedup"][curve][against] == pytest.approx(
                measured["projected_speedup"][curve][against])
    groups = {g["key"]: g for g in measured["groups"]}
    for row in data["groups"]:
        assert row["predicted_tokens_per_step"] == pytest.approx(groups[row["key"]]["tokens_per_step"])
        assert row["predicted_speedup"]["cpu"]["vs_plain"] == pytest.approx(
            groups[row["key"]]["projected_speedup"]["cpu"]["vs_plain"])
    assert data["prediction"]["exhaustive"] and data["prediction"]["params"] == REPLAY_DEFAULTS
    # A sample: an interval around the estimate, and the table prints it.
    res = run("entropy", "--db", db, "--sample-calls", "5", "--sampling", "calls")
    assert res.returncode == 0, res.stderr
    assert "tokens/step" in res.stdout and "95% interval" in res.stdout and "cpu: x plain" in res.stdout
    res = run("entropy", "--db", db, "--no-predict", "--json")
    assert res.returncode == 0 and "predicted_tokens_per_step" not in res.stdout


def test_learning_curve_plot(tmp_path, db):
    plot = tmp_path / "learning.png"
    res = run("entropy", "--db", db, "--sample-calls", "6", "--plot", str(plot), "--json")
    assert res.returncode == 0, res.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = json.loads(res.stdout)["prediction"]["learning_curve"]
    assert curve and [h for h, _ in curve] == sorted(h for h, _ in curve) and all(t >= 1 for _, t in curve)
    res = run("entropy", "--db", db, "--no-predict", "--plot", str(plot))
    assert res.returncode == 2 and "--no-predict" in res.stderr


def test_bad_input_is_one_clear_line(tmp_path, db):
    curve = tmp_path / "curve.json"
    curve.write_text('{"1": 1.0, "8": "cheap"}')
    for command in ("entropy", "replay"):
        res = run(command, "--db", db, "--cost-curve", str(curve))
        assert res.returncode == 1, res.stderr
        assert res.stderr.strip() == f"error: cost curve {curve}: '8' must be a positive number, got 'cheap'"
    curve.write_text("{oops")
    res = run("entropy", "--db", db, "--cost-curve", str(curve))
    assert res.returncode == 1 and "not JSON (line 1, column 2" in res.stderr and "Traceback" not in res.stderr
    res = run("entropy", "--db", db, "--sample-calls", "100000")
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1
    assert "--sample-calls 100,000 is more than the" in res.stderr and "Traceback" not in res.stderr
    res = run("entropy", "--db", db, "--format", "no-such-format")
    assert res.returncode == 2 and "no stored call matches the selection" in res.stderr
    res = run("entropy", "--db", db, "--sampling", "random")
    assert res.returncode == 2 and "weighted" in res.stderr


def test_bench_cost_writes_a_curve_the_predictor_reads(tmp_path, db):
    curve = tmp_path / "mine.json"
    res = run("bench", "cost", "--repeats", "1", "--context", "32", "--out", str(curve), "--json")
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)
    assert json.loads(curve.read_text()) == measured
    assert "1" in measured["cost"] and all(v > 0 for v in measured["cost"].values())
    res = run("entropy", "--db", db, "--cost-curve", str(curve), "--json")
    assert res.returncode == 0, res.stderr
    speedup = json.loads(res.stdout)["overall"]["predicted_speedup"]
    assert set(speedup) == {"flat", "cpu", "mine"} and speedup["mine"]["vs_plain"] > 0
