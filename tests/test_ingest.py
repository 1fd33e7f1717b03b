"""`specx ingest` into a real SQLite file: counts, idempotency, bad input, a killed ingest, the index."""

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import brute
from helpers.cli import AGENT_DATA, specx_in_process
from helpers.logs import FIXTURES, good_logs, write_pairs
from specx.core.index.suffix_index import SuffixIndex
from specx.store.db import Store
from specx.store.formats import Call, read_calls
from specx.store.index import load_index
from specx.store.ingest import ingest


def expected_calls(root: Path) -> int:
    from specx.store.formats import find_logs

    return sum(isinstance(c, Call) for p, f in find_logs([root]) if f for c in read_calls(p, f))


def test_ingest_counts_and_reingest_adds_nothing(tmp_path, tokenizer):
    root = good_logs(tmp_path)
    with Store(tmp_path / "s.db") as store:
        first = ingest(store, [root], tokenizer)
        assert first.errors == []
        assert first.calls == first.new_calls == expected_calls(root) > 15
        assert set(first.by_format) == {"aider", "claude-code", "text2sql-multiagent", "openai-chat", "openhands",
                                        "swe-agent", "jsonl-pairs"}
        assert first.index["action"] == "built"
        second = ingest(store, [root], tokenizer)
        assert (second.new_calls, second.new_tokens, second.skipped_files) == (0, 0, second.files)
        assert second.calls == first.calls
        assert second.index["action"] == "unchanged"
        assert store.stats()["calls"] == first.calls


def test_stored_calls_round_trip(tmp_path, tokenizer):
    root = good_logs(tmp_path)
    with Store(tmp_path / "s.db") as store:
        ingest(store, [root], tokenizer)
        from specx.store.formats import find_logs

        calls = [c for p, f in find_logs([root]) if f for c in read_calls(p, f) if isinstance(c, Call)]
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        ids = [r[0] for r in store.db.execute("SELECT id FROM calls ORDER BY id")]
        assert len(ids) == len(calls)
        for cid, call in zip(ids, calls):  # stored in reading order
            assert store.call_output(cid) == call.output_text
            expected_prompt = call.prompt_messages if call.prompt_messages is not None else (
                [{"role": "prompt_text", "content": call.prompt_text}] if call.prompt_text is not None else None)
            assert store.call_prompt(cid) == (json.loads(json.dumps(expected_prompt, default=str))
                                              if expected_prompt is not None else None)
            tokens = store.call_tokens(cid, tok_id)
            assert tokens.tolist() == tokenizer.get().encode(call.output_text, add_special_tokens=False)


def test_modified_file_adds_only_new_calls(tmp_path, tokenizer):
    log = write_pairs(tmp_path / "pairs.jsonl")
    with Store(tmp_path / "s.db") as store:
        first = ingest(store, [log], tokenizer)
        with log.open("a") as f:
            f.write(json.dumps({"prompt": "one more", "completion": "SELECT 42"}) + "\n")
        second = ingest(store, [log], tokenizer)
        assert second.new_calls == 1
        assert store.stats()["calls"] == first.calls + 1
        assert second.index["action"] in ("updated", "rebuilt")


def test_bad_input_is_reported_and_the_rest_is_kept(tmp_path, tokenizer):
    root = good_logs(tmp_path)
    bad = root / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{not json\n"
                   + json.dumps({"prompt": "c", "completion": "d"}) + "\n")
    (root / "latin1.json").write_bytes((FIXTURES / "latin1.json").read_bytes())
    (root / "empty.jsonl").write_bytes(b"")
    shutil.copy(FIXTURES / "swe_agent" / "truncated.traj", root / "swe_agent" / "truncated.traj")
    with Store(tmp_path / "s.db") as store:
        report = ingest(store, [root, tmp_path / "missing.jsonl"], tokenizer)
        where = {(Path(e["path"]).name, e["line"]) for e in report.errors}
        assert ("bad.jsonl", 2) in where  # the malformed line, by file and line
        assert ("missing.jsonl", None) in where
        assert any(name == "truncated.traj" for name, _ in where)  # a truncated file: reported, others go on
        assert report.by_format["jsonl-pairs"] >= 2  # bad.jsonl's two good lines are kept
        messages = " ".join(e["message"] for e in report.errors)
        assert "Traceback" not in messages
        assert report.calls >= expected_calls(good_logs(tmp_path / "again"))


def test_unknown_explicit_file_is_an_error_but_folder_extras_are_skipped(tmp_path, tokenizer):
    root = good_logs(tmp_path)
    (root / "README.md").write_text("# notes\nnot a log\n")
    with Store(tmp_path / "s.db") as store:
        report = ingest(store, [root], tokenizer)
        assert report.errors == [] and any(p.endswith("README.md") for p in report.unrecognized)
        report = ingest(store, [root / "README.md"], tokenizer)
        assert [Path(e["path"]).name for e in report.errors] == ["README.md"]
        assert "unknown log format" in report.errors[0]["message"]


def test_persisted_index_loads_without_rebuild_and_counts_are_exact(tmp_path, tokenizer, monkeypatch):
    root = good_logs(tmp_path)
    with Store(tmp_path / "s.db") as store:
        ingest(store, [root], tokenizer)
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        docs = [t.tolist() for _, t in store.iter_tokens(tok_id)]

        def no_build(*a, **k):
            raise AssertionError("the index was rebuilt")

        monkeypatch.setattr(SuffixIndex, "build", no_build)
        monkeypatch.setattr("specx.core.index.sealed.build_suffix_array", no_build)
        index = load_index(store, tok_id)
        monkeypatch.undo()
        assert [s.tolist() for _, s in index.sequences()] == docs
        rng = np.random.default_rng(0)
        for _ in range(30):
            doc = docs[rng.integers(len(docs))]
            if len(doc) < 4:
                continue
            i = int(rng.integers(len(doc) - 3))
            pat = doc[i : i + 3]
            assert index.count(pat) == brute.count(docs, pat)
            assert index.children(pat) == brute.children(docs, pat)


def test_incremental_index_update_equals_fresh_build(tmp_path, tokenizer):
    root = good_logs(tmp_path)
    with Store(tmp_path / "s.db") as store:
        ingest(store, [root / "mmsql_multiagent.json", root / "swe_agent", root / "claude_code.jsonl"], tokenizer)
        report = ingest(store, [write_pairs(tmp_path / "two.jsonl", 1)], tokenizer)  # few new tokens: added online
        assert report.index["action"] == "updated"
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        loaded = load_index(store, tok_id)
        fresh = SuffixIndex.build([t for _, t in store.iter_tokens(tok_id)])
        assert [s.tolist() for _, s in loaded.sequences()] == [s.tolist() for _, s in fresh.sequences()]
        for _, seq in fresh.sequences():
            for k in range(0, max(len(seq) - 2, 0), 7):
                pat = seq[k : k + 2].tolist()
                assert loaded.count(pat) == fresh.count(pat)


def test_not_a_store_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.db"
    bad.write_text("this is not sqlite " * 100)
    with pytest.raises(ValueError, match="not a usable specx store"):
        Store(bad)


def make_many_logs(root: Path, num_files: int, lines: int) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(7)
    words = ["SELECT", "name", "FROM", "users", "WHERE", "age", ">", "30", "ORDER", "BY", "id", "LIMIT", "10"]
    for f in range(num_files):
        with (root / f"log{f:04d}.jsonl").open("w") as out:
            for i in range(lines):
                text = " ".join(rng.choice(words, size=int(rng.integers(5, 40))))
                out.write(json.dumps({"prompt": f"question {f}-{i}", "completion": text}) + "\n")


def run_cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "specx", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def test_killed_ingest_leaves_a_consistent_store(tmp_path, tokenizer):
    tokenizer.get()  # the subprocesses reuse the cached tokenizer
    logs = tmp_path / "logs"
    make_many_logs(logs, num_files=80, lines=30)
    db = tmp_path / "killed.db"
    proc = run_cli("ingest", str(logs), "--db", str(db))
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until some files are in, then kill without warning
        if db.exists():
            try:
                with sqlite3.connect(db, timeout=1) as c:
                    if c.execute("SELECT count(*) FROM sources").fetchone()[0] >= 5:
                        break
            except sqlite3.OperationalError:
                pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # Every recorded source has all of its calls, each with tokens: files are all in or all out.
        for sid, num_calls in c.execute("SELECT id, num_calls FROM sources").fetchall():
            stored = c.execute("SELECT count(*) FROM calls c JOIN sessions s ON s.id = c.session_id"
                               " WHERE s.source_id = ?", [sid]).fetchone()[0]
            assert stored == num_calls
        assert c.execute("SELECT count(*) FROM calls c WHERE NOT EXISTS"
                         " (SELECT 1 FROM tokens t WHERE t.call_id = c.id)").fetchone()[0] == 0
        partial = c.execute("SELECT count(*) FROM calls").fetchone()[0]
    assert 0 < partial < 80 * 30
    done = run_cli("ingest", str(logs), "--db", str(db), "--json")
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    assert json.loads(out)["calls"] == 80 * 30
    with Store(db) as store:
        assert store.stats()["calls"] == 80 * 30
        tok_id = store.tokenizer_id(tokenizer.fingerprint)
        assert load_index(store, tok_id).num_sequences == 80 * 30


def test_cli_ingest_and_ls(tmp_path, tokenizer):
    tokenizer.get()
    root = good_logs(tmp_path)
    (root / "broken.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    db = tmp_path / "cli.db"
    proc = run_cli("ingest", str(root), "--db", str(db), "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1  # something failed; the summary is still printed
    data = json.loads(out)
    assert {"files", "calls", "new_calls", "by_format", "errors"} <= data.keys()
    assert [(Path(e["path"]).name, e["line"]) for e in data["errors"]] == [("broken.jsonl", 2)]
    proc = run_cli("ls", "--db", str(db), "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stats = json.loads(out)
    assert stats["calls"] == data["calls"] and stats["disk_bytes"] > 0
    proc = run_cli("ls", "--db", str(tmp_path / "none.db"))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "specx ingest" in err and "Traceback" not in err


@pytest.mark.skipif(not AGENT_DATA.is_dir(), reason="needs ../shared/agent-data")
def test_ingest_all_public_agent_logs(tmp_path, tokenizer):
    with Store(tmp_path / "agent.db") as store:
        report = ingest(store, [AGENT_DATA], tokenizer)
        assert report.errors == []
        assert report.by_format["swe-agent"] == 1154
        assert report.calls == report.new_calls and report.calls > 5000
        again = ingest(store, [AGENT_DATA], tokenizer)
        assert again.new_calls == 0 and again.skipped_files == again.files


def test_bench_ingest_command(tmp_path, tokenizer):
    tokenizer.get()
    root = good_logs(tmp_path)
    res = specx_in_process("bench", "ingest", str(root), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["calls"] == expected_calls(root) and data["errors"] == 0
    assert data["reingest_new_calls"] == 0
    assert 0 < data["store_bytes"] and data["log_bytes"] > 0
    assert set(data["targets_met"]) == {"ingest_s", "reingest_s", "reingest_new_calls", "store_vs_logs"}


def test_a_store_keyed_by_file_name_gets_no_duplicates(tmp_path, tokenizer, monkeypatch):
    # Before sessions were scoped by the file's real path, their keys held the file's name; a file
    # read again into such a store (grown, or for another tokenizer) adds only its new calls.
    import specx.store.ingest as ingest_module

    log = write_pairs(tmp_path / "pairs.jsonl")
    by_name = ingest_module.insert_calls
    monkeypatch.setattr(ingest_module, "insert_calls",
                        lambda store, source_id, path, fmt, calls, **_: by_name(store, source_id, path, fmt, calls))
    with Store(tmp_path / "s.db") as store:
        assert ingest(store, [log], tokenizer).new_calls == 6
    monkeypatch.undo()
    with log.open("a") as f:
        f.write(json.dumps({"prompt": "one more", "completion": "SELECT 42"}) + "\n")
    with Store(tmp_path / "s.db") as store:
        report = ingest(store, [log], tokenizer)
        assert (report.new_calls, report.duplicate_calls) == (1, 6)
        assert store.stats()["calls"] == 7
