"""Damage and hostility a probe found past SQLite's own checks (issue 31): a compressed block
damaged inside, a block that would expand to gigabytes, JSON nested thousands deep, a lone
surrogate escape, a record too large to tokenize, two ingests creating one store at once. Each
runs the command line's entry point (helpers.stores.specx: in this process, or a real process
for the deep JSON and the lone surrogate, and the two ingests at once) and checks what is stored."""

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from specx.store import codec
from specx.store.db import Store

from helpers.stores import a_store, loaded_tokenizer, sha256, specx, write_pairs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return loaded_tokenizer(tmp_path_factory)


def damage_pack(db: Path, pack_id: int = 1) -> None:
    """Flip bytes inside a pack's zstd frame, header included: SQLite sees a healthy row."""
    with sqlite3.connect(db) as conn:
        blob = bytearray(conn.execute("SELECT data FROM packs WHERE id = ?", [pack_id]).fetchone()[0])
        for i in range(0, min(len(blob), 64)):
            blob[i] ^= 0x5A
        conn.execute("UPDATE packs SET data = ? WHERE id = ?", [bytes(blob), pack_id])
    conn.close()


def test_a_damaged_block_is_reported_by_check_and_refused_in_one_line(tmp_path, tokenizer):
    db = a_store(tmp_path, tokenizer)
    damage_pack(db)
    before = sha256(db)
    res = specx("check", "--db", str(db), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    packs = next(c for c in json.loads(res.stdout)["checks"] if c["check"] == "packs")
    assert not packs["ok"] and "pack 1" in packs["problems"][0]
    for command in (["entropy"], ["replay", "--no-baselines"]):
        res = specx(*command, "--db", str(db))
        assert res.returncode == 1 and "Traceback" not in res.stderr and "pack 1" in res.stderr, res.stderr
    assert sha256(db) == before


def test_merge_skips_a_damaged_source_and_merges_the_rest(tmp_path, tokenizer):
    good = a_store(tmp_path / "good", tokenizer)
    bad = tmp_path / "bad" / "store.db"
    with Store(bad) as store:
        from specx.store.ingest import ingest

        ingest(store, [write_pairs(tmp_path / "bad" / "a.jsonl", tag="a"),
                       write_pairs(tmp_path / "bad" / "b.jsonl", tag="b")], tokenizer)
    damage_pack(bad, 1)
    res = specx("merge", str(good), str(bad), "--db", str(tmp_path / "central.db"), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    out = json.loads(res.stdout)
    assert [m["new_calls"] for m in out["merged"]] == [400, 6]  # the good store whole, the other's sound source
    assert len(out["errors"]) == 1 and "not merged" in out["errors"][0]
    assert specx("check", "--db", str(tmp_path / "central.db")).returncode == 0


def test_a_block_that_would_expand_to_gigabytes_is_refused_unread(tmp_path, tokenizer):
    db = a_store(tmp_path, tokenizer)
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(b"\0" * (256 << 20))
    assert len(bomb) < (256 << 20) // codec.MAX_RATIO
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE packs SET data = ? WHERE id = 1", [bomb])
    conn.close()
    res = specx("merge", str(db), "--db", str(tmp_path / "central.db"), "--json")
    assert res.returncode == 1 and "expand" in res.stdout + res.stderr and "Traceback" not in res.stderr
    res = specx("check", "--db", str(db))
    assert res.returncode == 1 and "expand" in res.stderr


def test_deep_json_a_lone_surrogate_and_a_huge_output_are_named_and_the_rest_stored(tmp_path, tokenizer):
    from specx.store.ingest import MAX_OUTPUT_CHARS

    logs = tmp_path / "logs"
    write_pairs(logs / "a.jsonl", tag="a")
    deep = "[" * 5000 + "]" * 5000
    (logs / "b.jsonl").write_text(json.dumps({"prompt": "p", "completion": "SELECT 1;"}) + "\n"
                                  + '{"prompt": "q", "completion": ' + deep + "}\n")
    (logs / "c.jsonl").write_text('{"prompt": "r", "completion": "SELECT \\ud800 FROM t;"}\n')
    (logs / "d.jsonl").write_text(json.dumps({"prompt": "s", "completion": "x" * (MAX_OUTPUT_CHARS + 1)}) + "\n"
                                  + json.dumps({"prompt": "s", "completion": "SELECT 2;"}) + "\n")
    write_pairs(logs / "e.jsonl", tag="e")
    res = specx("ingest", str(logs), "--db", str(tmp_path / "s.db"), "--json", real=True)  # its own stack and stdout
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    report = json.loads(res.stdout)
    errors = {(Path(e["path"]).name, e.get("line")): e["message"] for e in report["errors"]}
    assert "nested too deep" in errors[("b.jsonl", 2)]
    assert "characters" in errors[("d.jsonl", 1)]
    assert report["new_calls"] == 6 + 1 + 1 + 1 + 6  # a, b's good line, c, d's good line, e
    assert specx("check", "--db", str(tmp_path / "s.db")).returncode == 0


@pytest.mark.slow  # six real processes
def test_two_ingests_creating_one_store_at_once_both_succeed(tmp_path, tokenizer):
    for trial in range(3):  # before: one of the two failed in 2 of 4 trials
        db = tmp_path / f"new{trial}.db"
        logs = [write_pairs(tmp_path / f"{trial}{tag}" / "pairs.jsonl", tag=tag) for tag in ("x", "y")]
        runs = [subprocess.Popen([sys.executable, "-m", "specx", "ingest", str(log), "--db", str(db)],
                                 stderr=subprocess.PIPE, text=True) for log in logs]
        for proc in runs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
        with Store(db) as store:
            assert store.db.execute("SELECT count(*) FROM calls").fetchone()[0] == 12


def test_a_log_folder_typed_two_ways_is_one_set_of_sessions(tmp_path, tokenizer, monkeypatch):
    """Case 11: OpenHands completion logs ingested as `logs` into one store and by their absolute
    path into another; merged, nothing is new (their session ids were the folder as typed)."""
    from specx.store.ingest import ingest
    from specx.store.merge import merge

    logs = tmp_path / "logs" / "CodeActAgent" / "task"
    logs.mkdir(parents=True)
    for n in range(1, 4):
        (logs / f"prompt_{n:03d}.log").write_text(f"prompt {n}: fix the bug in module {n}")
        (logs / f"response_{n:03d}.log").write_text(f"I will open module_{n}.py and edit line {n}.")
    monkeypatch.chdir(tmp_path)
    for name, typed in (("a", Path("logs")), ("b", tmp_path / "logs")):
        with Store(tmp_path / f"{name}.db") as store:
            assert ingest(store, [typed], tokenizer).new_calls == 3
    with Store(tmp_path / "a.db") as dest, Store(tmp_path / "b.db") as src:
        report = merge(dest, src)
    assert (report.new_calls, report.known_calls) == (0, 3)
