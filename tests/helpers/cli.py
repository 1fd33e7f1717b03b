"""`specx` as the tests run it: in this process (`specx_in_process`), with the tests' home folder
(`specx_test_home`), over the public agent logs beside the checkout (`AGENT_DATA`, when present)."""

import contextlib
import io
import os
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AGENT_DATA = REPO.parent / "shared" / "agent-data"


def specx_test_home(tmp_path_factory) -> Path:
    """The tests' SPECX_HOME: one per session (tokenizer and model caches), or SPECX_TEST_HOME."""
    return Path(os.environ.get("SPECX_TEST_HOME") or tmp_path_factory.getbasetemp() / "specx-home")


def specx_in_process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`specx ARGS` run in this process by the console script's own entry point (specx.commands.app.main:
    its exit status, errors as one line, stdout and stderr captured), as `python -m specx ARGS` would
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
