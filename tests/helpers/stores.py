"""Stores for the tests of hostile input and damage (test_store_hostile.py, test_store_damage.py):
a healthy store (`a_store`), `specx` run in this process or as a process of its own, and the check
that a refusal is one line of error (`one_line_error`)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
from specx.store.db import Store
from specx.store.ingest import Tokenizer, ingest

from helpers.cli import specx_in_process


def loaded_tokenizer(tmp_path_factory) -> Tokenizer:
    """The built-in model's tokenizer, loaded now (these tests' commands, some run as processes of
    their own, read the cached copy)."""
    cache = tmp_path_factory.getbasetemp() / "specx-home" / "models"  # conftest's SPECX_HOME: subprocesses share it
    tok = Tokenizer("smollm2-135m", lambda: load_tokenizer("smollm2-135m", cache), tokenizer_fingerprint)
    tok.get()
    return tok


def specx(*args: str, real: bool = False, prefix: list[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """`specx ARGS` in this process (helpers.cli.specx_in_process: the same entry point, exit status and
    output), or with `real` as a process of its own (after a `prefix` command, e.g. setpriv)."""
    if not real:
        return specx_in_process(*args)
    return subprocess.run([*prefix, sys.executable, "-m", "specx", *args], capture_output=True, text=True,
                          timeout=timeout)


def write_pairs(path: Path, n: int = 6, tag: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"rows in t{i}{tag}?", "completion": f"SELECT count(*) FROM t{i}{tag};"})
                    + "\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def a_store(tmp_path: Path, tokenizer) -> Path:
    """A healthy store holding a few calls, closed (its WAL folded back into the file)."""
    db = tmp_path / "store.db"
    with Store(db) as store:
        report = ingest(store, [write_pairs(tmp_path / "first" / "pairs.jsonl", n=400)], tokenizer)
        assert report.errors == [] and report.new_calls == 400
    assert not Path(f"{db}-wal").exists()
    return db


def one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for word in words:
        assert word in lines[0], res.stderr
