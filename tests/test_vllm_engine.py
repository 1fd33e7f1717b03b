"""specx inside a real vLLM engine (CPU backend, the built-in model): `make test-vllm` runs these in
its own venv; elsewhere they are skipped. Each engine runs in a fresh process through
examples/vllm_bench.py's one-engine mode, as the benchmark runs them."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

BENCH = Path(__file__).resolve().parents[1] / "examples" / "vllm_bench.py"
PROMPTS = [  # agent-like: a schema, earlier question/SQL pairs, then the question
    "/* SQLite database concert_singer */\nCREATE TABLE singer (Singer_ID, Name, Country, Age);\n\n"
    "/* Question: How many singers are there? */\nSELECT count(*) FROM singer;\n\n"
    "/* Question: List the names of singers older than 30. */\nSELECT",
    "/* SQLite database concert_singer */\nCREATE TABLE singer (Singer_ID, Name, Country, Age);\n\n"
    "/* Question: How many singers are there? */\nSELECT count(*) FROM singer;\n\n"
    "/* Question: What is the average age of all singers? */\nSELECT",
]


@pytest.fixture(scope="module")
def model_folder():
    sys.path.insert(0, str(BENCH.parent))
    from vllm_bench import builtin_model_folder

    return builtin_model_folder()


def engine(tmp_path, model_folder, method, store=None):
    """One engine in its own process over PROMPTS (greedy, 40 tokens); its measured result."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"history": [], "timed": PROMPTS}))
    out = tmp_path / f"{method}-{os.urandom(3).hex()}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECX_DB")}
    if store is not None:
        env["SPECX_DB"] = str(store)
        env["SPECX_SYNC_S"] = "0"
    # a context of 112 tokens: the last steps come within k of it, where vLLM skips the drafter, and
    # the stored outputs must still be whole (the drafter takes them from the engine at finish)
    cmd = [sys.executable, str(BENCH), "--run", method, "--prompts", str(prompts), "--out", str(out),
           "--model", str(model_folder), "--concurrency", "2", "--k", "8", "--max-new-tokens", "40",
           "--max-model-len", "112"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def test_specx_in_vllm_is_lossless_learns_and_starts_warm(tmp_path, model_folder):
    store = tmp_path / "agents.db"
    plain = engine(tmp_path, model_folder, "none")
    cold = engine(tmp_path, model_folder, "specx_cold", store)
    assert cold["outputs"] == plain["outputs"]  # greedy: identical tokens with and without specx
    assert cold["accepted_tokens"] > 0
    from specx.store.db import Store

    with Store(store) as s:  # what the first engine served, stored at its exit, once and whole
        assert s.db.execute("SELECT count(*) FROM calls").fetchone()[0] == len(PROMPTS)
        (tid,) = s.db.execute("SELECT id FROM tokenizers").fetchone()
        assert sorted(t.tolist() for _, t in s.iter_tokens(tid)) == sorted(cold["outputs"])
    warm = engine(tmp_path, model_folder, "specx_warm", store)  # a second process on the same store
    assert warm["outputs"] == plain["outputs"]
    assert warm["accepted_tokens"] > cold["accepted_tokens"]
