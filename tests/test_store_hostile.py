"""Ingest and the store under hostile conditions (issue 20): link loops, unreadable files, stores
from a newer specx or with damaged pages, nothing to read, the multi-submission SWE-agent layout,
calls read twice. Each runs the command line's entry point and checks its exit status and output:
in this process, or as a real process where the process matters (a user without root's file
access, a link loop bounded by a timeout)."""

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from helpers.stores import a_store, loaded_tokenizer, one_line_error, sha256, specx, write_pairs
from specx.store.db import Store

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
# Root reads every file whatever its mode; these take the override away from the command.
UNPRIVILEGED = (["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                 "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return loaded_tokenizer(tmp_path_factory)


def test_link_loops_end_and_each_file_is_read_once(tmp_path, tokenizer):
    logs = tmp_path / "logs"
    write_pairs(logs / "pairs.jsonl")
    (logs / "a").symlink_to(".")
    (logs / "b").symlink_to(".")
    (logs / "sub").mkdir()
    (logs / "sub" / "up").symlink_to("..")
    res = specx("ingest", str(logs), "--db", str(tmp_path / "s.db"), "--json", real=True, timeout=60)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["files"], data["calls"], data["new_calls"]) == (1, 6, 6)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv")
def test_unreadable_file_and_folder_are_errors_and_the_rest_is_read(tmp_path, tokenizer):
    logs = tmp_path / "logs"
    write_pairs(logs / "good.jsonl")
    secret = write_pairs(logs / "secret.jsonl", tag="s")
    locked = logs / "locked"
    write_pairs(locked / "inside.jsonl", tag="l")
    secret.chmod(0)
    locked.chmod(0)
    try:
        res = specx("ingest", str(logs), "--db", str(tmp_path / "s.db"), "--json", real=True, prefix=UNPRIVILEGED)
    finally:
        locked.chmod(0o755)
        secret.chmod(0o644)
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    failed = {Path(e["path"]).name: e["message"] for e in data["errors"]}
    assert set(failed) == {"secret.jsonl", "locked"}
    assert all("Permission denied" in message for message in failed.values())
    assert "secret.jsonl" not in " ".join(data["unrecognized"])
    assert (data["files"], data["new_calls"]) == (1, 6)  # the readable log is still ingested
    assert "Traceback" not in res.stderr


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


def test_nothing_to_read_creates_no_store(tmp_path, tokenizer):
    db = tmp_path / "new.db"
    res = specx("ingest", str(tmp_path / "missing.jsonl"), str(tmp_path / "gone"), "--db", str(db))
    assert res.returncode == 1
    assert not db.exists()
    assert "missing.jsonl: no such file or folder" in res.stderr and "Traceback" not in res.stderr


def test_an_empty_file_is_reported_as_empty(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    res = specx("ingest", str(empty), "--db", str(tmp_path / "s.db"), "--json")
    assert res.returncode == 1
    assert [(Path(e["path"]).name, e["message"]) for e in json.loads(res.stdout)["errors"]] == \
        [("empty.jsonl", "empty file")]


def test_trajectories_of_several_submissions_keep_their_own_sessions_and_models(tmp_path, tokenizer):
    # multi-swe-bench: <submission>/metadata.yaml, each trajectory in a folder of its own below it.
    root = tmp_path / "evaluation"
    submissions = {"20240825_sweagent_model-a": "model-a", "20240825_sweagent_model-b": "model-b",
                   "20240901_sweagent_model-a_retry": "model-a"}
    for folder, model in submissions.items():
        (root / folder / "trajs" / "demo__repo-1").mkdir(parents=True)
        (root / folder / "metadata.yaml").write_text(f"name: SWE-agent + {model}\noss: true\n")
        shutil.copy(FIXTURES / "swe_agent" / "demo__repo-1.traj", root / folder / "trajs" / "demo__repo-1")
    db = tmp_path / "s.db"
    res = specx("ingest", str(root), "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    per_file = json.loads(res.stdout)["calls"] // 3
    with sqlite3.connect(db) as conn:
        sessions = conn.execute("SELECT s.model, count(c.id) FROM sessions s JOIN calls c ON c.session_id = s.id"
                                " GROUP BY s.id ORDER BY s.model").fetchall()
        call_models = conn.execute("SELECT DISTINCT model FROM calls ORDER BY model").fetchall()
    conn.close()
    assert sessions == [("model-a", per_file), ("model-a", per_file), ("model-b", per_file)]
    assert call_models == [("model-a",), ("model-b",)]
    # Entropy and replay group by model.
    res = specx("entropy", "--db", str(db), "--by", "model", "--json")
    assert res.returncode == 0, res.stderr
    assert {g["key"]: g["calls"] for g in json.loads(res.stdout)["groups"]} == \
        {"model-a": 2 * per_file, "model-b": per_file}


def test_calls_read_again_are_counted_as_duplicates(tmp_path, tokenizer):
    dialogues = json.loads((FIXTURES / "mmsql_multiagent.json").read_text())
    log = tmp_path / "multiagent.json"
    log.write_text(json.dumps(dialogues + dialogues))  # a dialogue id that repeats, with the same outputs
    db = tmp_path / "s.db"
    res = specx("ingest", str(log), "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["calls"] == 2 * data["new_calls"] > 0
    assert data["duplicate_calls"] == data["new_calls"]
    res = specx("ingest", str(log), "--db", str(db))
    assert res.returncode == 0 and "already stored" in res.stdout
    # A grown log: what was stored before counts as duplicates, the new call as new.
    log.write_text(json.dumps(dialogues + dialogues + [{**dialogues[0], "id": 8}]))
    again = json.loads(specx("ingest", str(log), "--db", str(db), "--json").stdout)
    assert again["new_calls"] == data["new_calls"]
    assert again["duplicate_calls"] == again["calls"] - again["new_calls"]


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
    assert res.returncode == 1 and "no store" in res.stderr and not (tmp_path / "none.db").exists()


# ------------------------------------------------------------------ issue 47

@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None, reason="root without setpriv")
def test_a_read_only_store_is_read_and_a_writer_says_it_is_read_only(tmp_path, tokenizer):
    """Issue 47, case 5: a store in a read-only folder (or filesystem: users mount shared logs
    read-only) was "not a usable specx store (unable to open database file)" for every command,
    the store intact (WAL needs to write its -shm). Now the commands that only read open it
    read-only, immutable where no -shm can be made; ingest says the store is read-only."""
    folder = tmp_path / "shared"
    folder.mkdir()
    db = a_store(folder, tokenizer)
    more = write_pairs(tmp_path / "more" / "pairs.jsonl", tag="m")
    before = sorted(p.name for p in folder.iterdir())
    db.chmod(0o444)
    folder.chmod(0o555)
    try:
        ls = specx("ls", "--db", str(db), "--json", real=True, prefix=UNPRIVILEGED)
        check = specx("check", "--db", str(db), "--json", real=True, prefix=UNPRIVILEGED)
        replay = specx("replay", "--db", str(db), "--no-baselines", "--json", real=True, prefix=UNPRIVILEGED)
        ingest_ = specx("ingest", str(more), "--db", str(db), real=True, prefix=UNPRIVILEGED)
        engines = specx("engines", "--db", str(db), "--model", "none.gguf", real=True, prefix=UNPRIVILEGED)
    finally:
        folder.chmod(0o755)
        db.chmod(0o644)
    assert ls.returncode == 0, ls.stderr
    assert json.loads(ls.stdout)["calls"] == 400
    assert check.returncode == 0, check.stderr
    assert replay.returncode == 0, replay.stderr
    one_line_error(ingest_, str(db), "read-only here", "open it read-only")
    one_line_error(engines, "no such GGUF file: none.gguf")  # past the store's check: a read-only store is a store
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing was made beside it (no -wal, no -shm)


def test_a_full_disk_during_ingest_says_so_with_the_json_of_what_was_done(tmp_path, tokenizer, monkeypatch):
    """Issue 47, case 7: a full disk during ingest said "the store cannot be read: database or disk
    is full" and printed no JSON, though nothing was wrong with the store."""
    db = a_store(tmp_path, tokenizer)
    with sqlite3.connect(db) as conn:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.close()
    opened = Store.__init__

    def on_a_full_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self.db.execute(f"PRAGMA max_page_count = {pages + 1}")  # SQLite's SQLITE_FULL, as a full disk gives

    monkeypatch.setattr(Store, "__init__", on_a_full_disk)
    logs = [write_pairs(tmp_path / "more" / f"{name}.jsonl", n=300, tag=name) for name in ("a", "b")]
    res = specx("ingest", *map(str, logs), "--db", str(db), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    data = json.loads(res.stdout)
    assert data["new_calls"] == 0 and data["files"] == 1
    assert data["errors"][0]["message"].startswith(f"no space left on device writing {db}: ")
    assert "and the 1 files after it were not stored" in data["errors"][0]["message"]
    monkeypatch.setattr(Store, "__init__", opened)
    assert json.loads(specx("ls", "--db", str(db), "--json").stdout)["calls"] == 400  # the store is intact


@pytest.mark.parametrize("given", ["missing", "folder", "dev_null", "empty", "not_sqlite"])
def test_specx_engines_refuses_a_db_that_is_no_store(tmp_path, given):
    """Issue 47, case 9: `specx engines --db` ran the trial on the built-in prompts with rc 0 for a
    missing path, a folder or /dev/null, kept that choice, and made an empty file a store."""
    path = {"missing": tmp_path / "missing.db", "folder": tmp_path, "dev_null": Path("/dev/null"),
            "empty": tmp_path / "empty.db", "not_sqlite": tmp_path / "text.db"}[given]
    if given == "empty":
        path.write_bytes(b"")
    elif given == "not_sqlite":
        path.write_text("not a store\n" * 100)
    res = specx("engines", "--db", str(path))
    one_line_error(res, str(path))
    assert "no such store" in res.stderr or "not a store file" in res.stderr or "not a specx store" in res.stderr \
        or "cannot open the store (file is not a database)" in res.stderr, res.stderr
    if given == "empty":
        assert path.read_bytes() == b""  # not made into a store
