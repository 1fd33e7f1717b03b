import contextlib
import io
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are compiled
# then), and other tests' imports (transformers) may import it first: without CUDA the GPU engine's
# kernels run in its interpreter (tests/test_gpu_engine.py), so it is set before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specx.core.model.load import warm_up_math  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AGENT_DATA = REPO.parent / "shared" / "agent-data"

# Tests build tiny models without load_model: settle torch's first-call math for them too (see there).
warm_up_math()
# The tests written for the transformers engine keep it (their references are its numerics), module
# fixtures and the servers they start included; tests/test_llamacpp.py asks for llama.cpp by name.
os.environ["SPECX_BACKEND"] = "transformers"


def specx_test_home(tmp_path_factory) -> Path:
    """The tests' SPECX_HOME: one per session (tokenizer and model caches), or SPECX_TEST_HOME."""
    return Path(os.environ.get("SPECX_TEST_HOME") or tmp_path_factory.getbasetemp() / "specx-home")


@pytest.fixture(autouse=True)
def _specx_home(tmp_path_factory, monkeypatch):
    # Never write caches into the user's home from tests; share one per session (tokenizer cache).
    monkeypatch.setenv("SPECX_HOME", str(specx_test_home(tmp_path_factory)))


@pytest.fixture(scope="session")
def builtin_tokenizer(tmp_path_factory):
    """The built-in model's tokenizer (no weights: ~1 s from the tests' cache)."""
    from specx.core.model.load import load_tokenizer

    return load_tokenizer("smollm2-135m", specx_test_home(tmp_path_factory) / "models")


@pytest.fixture(scope="session")
def builtin_model(tmp_path_factory):
    """The built-in model and its tokenizer, loaded once for the tests that decode with it and only
    read it (the first load converts its GGUF into the tests' models folder, ~30 s; later ones, in
    the commands the tests run, read that copy)."""
    from specx.core.model.load import load_model

    return load_model("smollm2-135m", specx_test_home(tmp_path_factory) / "models", device="cpu")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """`specx serve --api-key` on the built-in model, one process for the session: the requests of
    test_serve.py and test_serve_agents.py share it (servers started with other options, or for one
    test, are test_serve_lifecycle.py's)."""
    from test_serve import KEY, Server

    srv = Server(str(specx_test_home(tmp_path_factory)), tmp_path_factory.mktemp("serve") / "served.db", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def builtin_vocabulary(builtin_tokenizer):
    """The built-in tokenizer as llguidance reads it (core.decode.grammar.Vocabulary)."""
    from specx.core.decode.grammar import Vocabulary

    return Vocabulary(builtin_tokenizer, len(builtin_tokenizer), builtin_tokenizer.eos_token_id)


def specx_in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`specx ARGS` run in this process by the console script's own entry point (specx.commands.app.main: its
    exit status, errors as one line, stdout and stderr captured), as `python -m specx ARGS` would
    run it, without a fresh interpreter's imports and the model kernel's compile (a few seconds
    each). `env` is set for the call only; torch's and numba's thread counts, which a command's
    thread tuner may change, are restored after. Tests about the process itself (signals, a child
    that dies, two processes at once, the stderr of a fresh interpreter) spawn one instead."""
    import numba
    import torch

    from specx.commands.app import main

    saved_env = {k: os.environ.get(k) for k in (env or {})}
    saved_argv, saved_main = sys.argv, sys.modules["__main__"]
    threads = torch.get_num_threads(), numba.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env or {})
    # click names the program from __main__ and argv[0]: "specx", as the console script (not pytest's)
    sys.argv, sys.modules["__main__"] = ["specx", *args], types.ModuleType("__main__")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv, sys.modules["__main__"] = saved_argv, saved_main
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads[0])
        numba.set_num_threads(threads[1])
    return subprocess.CompletedProcess(["specx", *args], code, out.getvalue(), err.getvalue())
