"""The store under hostile conditions (issue 20): stores from a newer specx or with damaged pages,
and `specx check`. Each runs the command line as a user would: a real subprocess."""

import hashlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from specx.core.model import load_tokenizer, tokenizer_fingerprint
from specx.store.db import Store
from specx.store.ingest import Tokenizer, ingest



@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "specx-home" / "models"  # conftest's SPECX_HOME: subprocesses share it
    tok = Tokenizer("smollm2-135m", lambda: load_tokenizer("smollm2-135m", cache), tokenizer_fingerprint)
    tok.get()
    return tok


def specx(*args: str, prefix: list[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
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


@pytest.mark.parametrize("newer", ["user_version", "migration"])
def test_store_from_a_newer_specx_is_refused_and_left_untouched(tmp_path, tokenizer, newer):
    db = a_store(tmp_path, tokenizer)
    with sqlite3.connect(db) as conn:
        if newer == "user_version":
            conn.execute("PRAGMA user_version = 999")
        else:
            conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at)"
                         " VALUES ('specx', 'm999_from_the_future', '2030-01-01')")
    conn.close()
    before = sha256(db)
    more = write_pairs(tmp_path / "more" / "pairs.jsonl", tag="m")
    one_line_error(specx("ingest", str(more), "--db", str(db)), str(db), "newer specx")
    one_line_error(specx("ls", "--db", str(db)), "newer specx")
    assert sha256(db) == before


def corrupt_table(db: Path, table: str) -> None:
    """Overwrite the root page of a table's b-tree with garbage (its header first)."""
    with sqlite3.connect(db) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", [table]).fetchone()[0]
    conn.close()
    with db.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\x0b\xad" * (page_size // 4))


def test_corrupt_store_is_refused_by_every_command_and_left_untouched(tmp_path, tokenizer):
    db = a_store(tmp_path, tokenizer)
    corrupt_table(db, "calls")
    before = sha256(db)
    more = write_pairs(tmp_path / "more" / "pairs.jsonl", tag="m")
    one_line_error(specx("ingest", str(more), "--db", str(db)), str(db), "corrupt")
    for command in (["ls"], ["entropy"], ["replay", "--no-baselines"]):
        one_line_error(specx(*command, "--db", str(db)), "corrupt")
    assert sha256(db) == before
    res = specx("check", "--db", str(db), "--json")
    assert res.returncode == 1
    report = json.loads(res.stdout)
    integrity = next(c for c in report["checks"] if c["check"] == "integrity")
    assert not report["ok"] and not integrity["ok"] and integrity["problems"]
    assert sha256(db) == before


def test_check_names_what_is_wrong_and_writes_nothing(tmp_path, tokenizer):
    db = a_store(tmp_path, tokenizer)
    res = specx("check", "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    healthy = json.loads(res.stdout)
    assert healthy["ok"] and [c["check"] for c in healthy["checks"]] == \
        ["schema", "integrity", "packs", "calls", "token rows", "index smollm2-135m"]
    with sqlite3.connect(db) as conn:
        # A token row claiming more tokens than its pack holds, and an index that no longer
        # covers the rows it says it does (a row it covers is gone).
        conn.execute("UPDATE tokens SET num_tokens = 1000000 WHERE rowid = 3")
        conn.execute("DELETE FROM tokens WHERE rowid = 5")
    conn.close()
    before = sha256(db)
    res = specx("check", "--db", str(db))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "token rows: token row 3 (call 3): 1000000 tokens outside pack" in res.stderr
    assert "index smollm2-135m: covers 400 token rows up to row 400, but the store has 399 there" in res.stderr
    assert sha256(db) == before
    res = specx("check", "--db", str(tmp_path / "none.db"))
    assert res.returncode == 2 and "no store" in res.stderr and not (tmp_path / "none.db").exists()
