"""Model-free replay: hand-worked step traces, baselines, every stored output rebuilt, the commands."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import AGENT_DATA, specx_in_process
from specx.core.cost.forward import ForwardCost
from specx.core.decode.speculate import PromptLookupDrafter, SuffixDrafter
from specx.core.decode.verifiers.recorded import ReplayMismatch
from specx.core.draft import Draft
from specx.core.index.suffix_index import SuffixIndex
from specx.core.predict.replay import replay, replay_call

from helpers.logs import good_logs


def arr(*tokens):
    return np.array(tokens, dtype=np.int32)


def test_hand_worked_replay_from_the_global_index():
    # core/predict/replay.py's docstring, step by step: global index [7, 8, 9]; prompt [1]; output [7, 8, 9, 5].
    drafter = SuffixDrafter(SuffixIndex.build([[7, 8, 9]]))
    trace = []
    stats = replay_call(drafter, arr(1), arr(7, 8, 9, 5), trace=trace)
    assert trace == [(0, 0), (1, 1), (0, 0)]  # (draft size, accepted) per step
    assert (stats.steps, stats.tokens, stats.accepted, stats.drafted) == (3, 4, 1, 1)
    assert stats.to_json()["tokens_per_step"] == pytest.approx(4 / 3)


def test_replay_timed_by_a_cost_curve():
    # The docstring's replay again, on a device where a pass over n tokens takes 1 + (n - 1) / 2 s:
    # steps of 1, 2 and 1 tokens take 1 + 1.5 + 1 s; plain decoding takes 1 s per output token.
    cost = ForwardCost((1, 2), (1.0, 1.5))
    for size in (False, True):  # the one-node draft pays (2 tokens expected for 1.5 s), so sizing keeps it
        trace = []
        stats = replay_call(SuffixDrafter(SuffixIndex.build([[7, 8, 9]])), arr(1), arr(7, 8, 9, 5), trace=trace,
                            cost=cost, size=size)
        assert trace == [(0, 0), (1, 1), (0, 0)]
        assert (stats.pass_seconds, stats.plain_seconds) == (3.5, 4.0)
        assert stats.to_json()["simulated_speedup"] == pytest.approx(4 / 3.5)
    assert "simulated_speedup" not in replay_call(SuffixDrafter(), arr(1), arr(7, 8)).to_json()


def test_replay_sizing_by_cost_curve():
    # Data where the drafts are right: outputs repeat, so the global index predicts them.
    outputs = [arr(*range(10, 40))] * 4
    flat = ForwardCost((1, 64), (1.0, 1.0))  # a GPU-like curve: drafts cost nothing
    steep = ForwardCost((1, 2), (1.0, 2.0))  # a pass costs per token: no draft can pay
    runs = {}
    for name, cost in (("flat", flat), ("steep", steep)):
        drafter, total = SuffixDrafter(max_spec_factor=4.0), []
        for out in outputs:
            total.append(replay_call(drafter, arr(1, 2), out, cost=cost))
        runs[name] = total[-1]
    assert runs["steep"].drafted == 0 and runs["steep"].steps == 30
    assert runs["steep"].pass_seconds == runs["steep"].plain_seconds == 30.0
    assert runs["flat"].steps < 10 and runs["flat"].pass_seconds == runs["flat"].steps


def test_hand_worked_replay_from_the_prompt_and_learning():
    # Prompt [5, 6, 7, 8, 5]; output [6, 7, 8, 9]. Step 1: the context ends with 5, which was
    # followed by 6 in the prompt: p = 1 drafts [6] (alpha 1), accepted; bonus 7. Step 2: the
    # context ends [5, 6, 7] (p = 3, count 2: the prompt's and the context's own end): child 8 has
    # D = 1/2, then 5 and 6 follow it with C = 1: draft [8, 5, 6] (budget 3, score 1.5, beating
    # p = 2's 1.0); accept [8], bonus 9. Two steps for 4 tokens.
    drafter = SuffixDrafter()
    trace = []
    replay_call(drafter, arr(5, 6, 7, 8, 5), arr(6, 7, 8, 9), trace=trace)
    assert trace == [(1, 1), (3, 1)]
    # The output was learned: the same call again drafts from the global index too.
    trace = []
    replay_call(drafter, arr(1, 6), arr(7, 8, 9), trace=trace)
    assert trace[0][1] >= 1


def test_prompt_lookup_baseline():
    # Longest suffix n-gram ([1, 2], n = 2) at its earliest occurrence (0): draft what followed.
    drafter = PromptLookupDrafter(max_spec_tokens=3)
    drafter.start_request(arr(1, 2, 3, 9, 1, 2, 4, 1, 2))
    draft = drafter.speculate()
    assert (draft.token_ids, draft.parents, draft.match_len) == ([3, 9, 1], [-1, 0, 1], 2)
    drafter.start_request(arr(4, 5))
    assert len(drafter.speculate()) == 0


def test_replay_fails_loudly_when_acceptance_is_wrong(monkeypatch):
    drafter = SuffixDrafter(SuffixIndex.build([[7, 5, 6]]))  # drafts 5 after 7: the output has 8
    monkeypatch.setattr(Draft, "accepted_nodes", lambda self, cont: list(range(len(self.token_ids))))  # all, always
    with pytest.raises(ReplayMismatch, match="first difference"):
        replay_call(drafter, arr(1, 7), arr(8, 9, 4))


def test_replay_groups_and_totals():
    calls = [("a", arr(1, 2), arr(1, 2, 3)), ("b", arr(), arr(1, 2, 3)), ("a", arr(9), arr(1, 2, 3, 4))]
    result = replay(calls, SuffixDrafter())
    assert result.overall.calls == 3 and result.overall.tokens == 10
    assert result.groups["a"].calls == 2 and result.groups["b"].tokens == 3
    assert sum(t for t, _ in result.curve) == 10
    assert result.overall.steps == sum(g.steps for g in result.groups.values())


@pytest.mark.slow  # every public agent log ingested, tokenized and replayed
@pytest.mark.skipif(not AGENT_DATA.is_dir(), reason="needs ../shared/agent-data")
def test_every_stored_output_is_rebuilt(tmp_path, tokenizer):  # noqa: F811
    from specx.store.db import Store
    from specx.store.ingest import ingest
    from specx.store.prompts import prompt_tokens
    from specx.store.selection import select_calls

    with Store(tmp_path / "all.db") as store:
        ingest(store, [AGENT_DATA], tokenizer)
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        calls = select_calls(store, tok_id)
        formats = {c.format for c in calls}
        assert {"swe-agent", "openhands", "text2sql-multiagent", "sql-lines", "openai-chat"} <= formats
        prompts = prompt_tokens(store, tokenizer.get(), calls, 4096)
        outputs = [store.call_tokens(c.id, tok_id) for c in calls]
        # Tokenizing each message once equals rendering and tokenizing whole prompts.
        from specx.store.prompts import _prompt_tokens_rendered

        some = calls[::8]
        slow = _prompt_tokens_rendered(store, tokenizer.get(), some, 4096)
        assert all(np.array_equal(prompts[8 * i], s) for i, s in enumerate(slow))
    result = replay(((c.format, p, o) for c, p, o in zip(calls, prompts, outputs)), SuffixDrafter())
    assert result.overall.calls == len(calls)  # replay_call raised for none of them
    assert result.overall.tokens == sum(len(o) for o in outputs)
    for fmt in formats:
        assert result.groups[fmt].to_json()["tokens_per_step"] > 1.0


def run(*args):
    return subprocess.run([sys.executable, "-m", "specx", *args], capture_output=True, text=True, timeout=600)


def test_replay_and_entropy_commands(tmp_path, tokenizer):  # noqa: F811
    """replay and entropy as real processes (JSON alone on stdout, exit statuses); the other calls in-process."""
    tokenizer.get()
    db = str(tmp_path / "cli.db")
    assert specx_in_process("ingest", str(good_logs(tmp_path)), "--db", db).returncode == 0
    plot = tmp_path / "curve.png"
    res = run("replay", "--db", db, "--json", "--plot", str(plot), "--by", "format")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert {"overall", "groups", "baselines"} <= data.keys()
    keys = set(data["overall"])
    assert {"calls", "output_tokens", "steps", "tokens_per_step", "accepted_per_step", "acceptance_rate",
            "mean_draft_size", "draft_us_per_token"} <= keys
    assert {"prompt_lookup", "request_only", "global_only"} <= data["baselines"].keys()
    assert all(set(b) == keys for b in data["baselines"].values())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sum(g["calls"] for g in data["groups"]) == data["overall"]["calls"]
    res = specx_in_process("replay", "--db", db, "--format", "swe-agent", "--limit", "1", "--no-baselines", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["overall"]["calls"] == 1
    res = specx_in_process("replay", "--db", db, "--format", "nonexistent")
    assert res.returncode == 2 and "no stored call" in res.stderr
    res = run("entropy", "--db", db, "--by", "agent", "--json")
    assert res.returncode == 0, res.stderr
    groups = json.loads(res.stdout)["groups"]
    assert groups and all({"key", "calls", "tokens", "entropy_bits"} <= g.keys() for g in groups)
    assert all(g["entropy_bits"] >= 0 for g in groups)


@pytest.mark.slow
def test_replay_with_the_model_is_lossless_and_learns(tmp_path, tokenizer):  # noqa: F811
    tokenizer.get()
    db = str(tmp_path / "model.db")
    assert specx_in_process("ingest", str(good_logs(tmp_path)), "--db", db).returncode == 0
    res = specx_in_process("replay", "--db", db, "--model", "smollm2-135m", "--limit", "4", "--max-tokens", "12",
                           "--prompt-window", "256", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    methods = data["methods"]
    assert set(methods) == {"plain", "prompt_lookup", "specx"} and data["calls"] == 4  # the default drafter on a CPU
    for name, row in methods.items():
        assert {"tokens_per_s", "tokens", "seconds", "identical_calls", "calls"} <= row.keys()
        assert row["identical_calls"] == row["calls"] == 4, name  # greedy: every method is lossless
        assert row["tokens"] == methods["plain"]["tokens"] > 0 and row["tokens_per_s"] > 0
    assert methods["specx"]["steps"] <= methods["specx"]["tokens"]
    assert methods["specx"]["speedup_vs_plain"] == pytest.approx(
        methods["specx"]["tokens_per_s"] / methods["plain"]["tokens_per_s"])
    res = specx_in_process("replay", "--db", db, "--model", "smollm2-135m", "--plot", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "--plot" in res.stderr


def test_the_oracle_bounds_suffix_drafting():
    # examples/cost_bound.py's bounds. The oracle drafts the best continuation of any earlier
    # occurrence of the context's last token, exactly as far as it agrees: every draft is accepted
    # whole, and it never needs more steps than a suffix drafter, whose every draft path is some
    # occurrence's continuation. PerfectCut keeps the suffix drafter's accepted path only: the same
    # steps, nothing verified in vain.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from cost_bound import OracleDrafter, PerfectCut

    rng = np.random.default_rng(4)
    templates = [rng.integers(0, 12, size=30) for _ in range(3)]
    calls = []
    for _ in range(12):
        out = templates[rng.integers(3)].copy()
        out[rng.integers(30, size=4)] = rng.integers(0, 12, size=4)  # a few edits per output
        calls.append((rng.integers(0, 12, size=10).astype(np.int32), out.astype(np.int32)))
    outputs = [o.tolist() for _, o in calls]
    oracle, suffix = OracleDrafter(outputs, 1), SuffixDrafter(max_spec_factor=4.0)
    cut = PerfectCut(outputs, max_spec_factor=4.0)
    fewer = 0
    for prompt, output in calls:
        by_oracle, by_suffix, by_cut = (replay_call(d, prompt, output) for d in (oracle, suffix, cut))
        assert by_oracle.accepted == by_oracle.drafted and by_cut.accepted == by_cut.drafted
        assert by_oracle.steps <= by_suffix.steps
        fewer += by_oracle.steps < by_suffix.steps
        assert (by_cut.steps, by_cut.accepted) == (by_suffix.steps, by_suffix.accepted)
        assert by_cut.drafted < by_suffix.drafted or by_suffix.drafted == by_suffix.accepted
    assert fewer > 0


def test_vllm_bench_takes_its_prompts_from_stored_calls(tmp_path, tokenizer):  # noqa: F811
    import argparse

    from specx.store.db import Store
    from specx.store.ingest import ingest

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import vllm_bench  # imports vLLM only inside its engines

    db = tmp_path / "agents.db"
    with Store(db) as store:
        ingest(store, [good_logs(tmp_path)], tokenizer)
    args = argparse.Namespace(model="smollm2-135m", db=str(db), format=None, source=["mmsql"], agent=None, requests=2,
                              max_model_len=40, max_new_tokens=8)
    prompts = vllm_bench.stored_prompts(args)  # the first 4 stored MMSQL calls, their last 31 tokens
    assert len(prompts) == 4
    assert all(0 < len(p) <= 31 and all(type(t) is int for t in p) for p in prompts)
    args.source = ["no-such-source"]
    assert vllm_bench.stored_prompts(args) == []
