"""The command line as a user runs it: a real subprocess, stdout/stderr and exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import typer.main

from specx.commands.app import app


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "specx", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def all_commands(group=None, prefix=()):
    click_group = typer.main.get_command(app) if group is None else group
    for name, cmd in click_group.commands.items():
        yield prefix + (name,), cmd
        if hasattr(cmd, "commands"):
            yield from all_commands(cmd, prefix + (name,))


def test_every_command_has_help_with_an_example():
    found = list(all_commands())
    assert found, "no commands registered"
    for path, cmd in found:
        assert cmd.help and cmd.help.strip(), f"{' '.join(path)} has no help text"
        if not hasattr(cmd, "commands"):
            assert "Example:" in cmd.help, f"{' '.join(path)} help has no example"


def test_python_dash_m_and_help():
    res = run("--help")
    assert res.returncode == 0
    assert "bench" in res.stdout


def test_bad_usage_exits_2():
    res = run("bench", "index", "--tokens", "-5")
    assert res.returncode == 2
    assert "--tokens" in res.stderr
    assert res.stdout == ""


def test_missing_logs_folder_is_a_clear_error(tmp_path):
    res = run("bench", "index", "--tokens", "5000", "--logs", str(tmp_path / "nope"))
    assert res.returncode == 2
    assert "nope" in res.stderr and "Traceback" not in res.stderr


def test_bench_index_json_is_one_object_with_the_figures():
    res = run("bench", "index", "--tokens", "30000", "--positions", "200", "--no-logs", "--json", "--no-reference")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)  # nothing but JSON on stdout
    for key in ["tokens", "build_tokens_per_s", "bytes_per_token", "load_tokens_per_s", "append_us_per_token",
                "speculate_p50_us", "speculate_p99_us", "mean_accepted"]:
        assert isinstance(data[key], (int, float)) and data[key] >= 0, key
    assert data["corpora"][0]["positions"] == 200
    assert data["tokens"] > 25000
    assert data["bytes_per_token"] < 16
    assert data["mean_accepted"] > 0.5  # templated records are predictable


def test_bench_table_on_stdout_progress_on_stderr():
    res = run("bench", "index", "--tokens", "20000", "--positions", "100", "--no-logs", "--no-reference")
    assert res.returncode == 0, res.stderr
    assert "speculate_p50_us" in res.stdout
    assert "synthetic corpus" in res.stderr


BUILD_REFERENCE = Path(__file__).resolve().parents[1] / "examples" / "build_reference.sh"


def test_reference_build_script_skips_an_installed_reference_and_names_a_failed_step(tmp_path):
    # Offline: the real build (download, cmake, install) is checked by hand in a fresh venv (README).
    stub = tmp_path / "stub" / "arctic_inference" / "suffix_decoding"
    stub.mkdir(parents=True)
    (stub.parent / "__init__.py").write_text("")
    (stub / "__init__.py").write_text("class SuffixDecodingCache:\n    pass\n")
    env = {**os.environ, "SPECX_REF_WORKDIR": str(tmp_path / "work")}
    res = subprocess.run(["bash", str(BUILD_REFERENCE), sys.executable], capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(tmp_path / "stub")}, timeout=120)
    assert res.returncode == 0 and "already installed" in res.stderr, res.stderr
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "arctic_inference-0.3.0.tar.gz").write_bytes(b"not a tarball")  # a damaged download
    res = subprocess.run(["bash", str(BUILD_REFERENCE), sys.executable], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 1 and "failed while: unpacking" in res.stderr, res.stderr
    res = subprocess.run(["bash", str(BUILD_REFERENCE), str(tmp_path / "no-python")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 1 and "no python executable" in res.stderr
