"""`specx merge`: another store's calls into this one, by content key, on real SQLite files."""

import json
import shutil
import subprocess
import sys

from specx.store.db import Store
from specx.store.formats import Call
from specx.store.index import load_index
from specx.store.ingest import ingest
from specx.store.merge import merge
from specx.store.served import record_served

from helpers.logs import good_logs, write_pairs


def contents(store: Store) -> dict[bytes, tuple]:
    """Every call by key: session and source keys, output, prompt messages, tokens per tokenizer fingerprint."""
    tokenizers = {tid: fp for tid, fp in store.db.execute("SELECT id, fingerprint FROM tokenizers")}
    out = {}
    for cid, key, skey, srckey, position, agent in store.db.execute(
            "SELECT c.id, c.key, s.key, src.key, c.position, c.agent FROM calls c JOIN sessions s ON s.id = c.session_id"
            " JOIN sources src ON src.id = s.source_id"):
        tokens = {fp: store.call_tokens(cid, tid) for tid, fp in tokenizers.items()}
        out[key] = (skey, srckey, position, agent, store.call_output(cid), store.call_prompt(cid),
                    {fp: None if t is None else t.tolist() for fp, t in tokens.items()})
    return out


def served(store: Store, session: str, text: str, tokens: list[int]) -> None:
    record_served(store, "m", [Call(session_id=session, position=0, output_text=text,
                                    prompt_messages=[{"role": "user", "content": f"ask {session}"}])],
                  [tokens], "fp-served", "m", 1000)


def test_merge_copies_what_is_missing_once(tmp_path, tokenizer):  # noqa: F811
    logs = good_logs(tmp_path)
    with Store(tmp_path / "central.db") as central:
        ingest(central, [logs], tokenizer)
    shutil.copy(tmp_path / "central.db", tmp_path / "replica.db")  # a replica seeded from the central store
    with Store(tmp_path / "replica.db") as replica:
        write_pairs(logs / "more.jsonl", n=3)  # the replica also ingests a file and serves two requests
        ingest(replica, [logs], tokenizer)
        served(replica, "cmpl-1", "SELECT 1", [5, 6, 7])
        served(replica, "cmpl-2", "SELECT 2", [5, 6, 8, 9])
        want = contents(replica)
    with Store(tmp_path / "central.db") as central:
        before = len(contents(central))
        with Store(tmp_path / "replica.db", readonly=True) as replica:
            report = merge(central, replica)
        assert report.new_calls == 5 and report.known_calls == before and report.new_sources == 2
        assert contents(central) == want  # every call, its prompt, output, keys and tokens
        for tid, name in central.db.execute("SELECT id, name FROM tokenizers"):
            rows, _ = central.token_rows(tid)
            assert load_index(central, tid).num_sequences == rows and central.index_state(tid).num_calls == rows
        with Store(tmp_path / "replica.db", readonly=True) as replica:
            again = merge(central, replica)
        assert (again.new_calls, again.new_token_rows, again.new_messages) == (0, 0, 0)
        assert contents(central) == want
    with Store(tmp_path / "empty.db") as empty, Store(tmp_path / "replica.db", readonly=True) as replica:
        merge(empty, replica)
        assert contents(empty) == want


def run(*args):
    return subprocess.run([sys.executable, "-m", "specx", *args], capture_output=True, text=True, timeout=300)


def test_merge_command_reports_a_bad_store_and_merges_the_rest(tmp_path):
    with Store(tmp_path / "a.db") as a:
        served(a, "cmpl-a", "SELECT 'a'", [1, 2])
    with Store(tmp_path / "b.db") as b:
        served(b, "cmpl-b", "SELECT 'b'", [3, 4])
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    res = run("merge", str(tmp_path / "b.db"), str(tmp_path / "junk.db"), str(tmp_path / "gone.db"),
              "--db", str(tmp_path / "a.db"), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    data = json.loads(res.stdout)
    assert [m["store"] for m in data["merged"]] == [str(tmp_path / "b.db")] and data["merged"][0]["new_calls"] == 1
    assert len(data["errors"]) == 2 and "junk.db" in data["errors"][0] and "gone.db" in data["errors"][1]
    res = run("merge", str(tmp_path / "a.db"), "--db", str(tmp_path / "a.db"))
    assert res.returncode == 1 and "cannot be merged into itself" in res.stderr
    with Store(tmp_path / "a.db") as a:
        assert sorted(o for (o,) in a.db.execute("SELECT output_bytes FROM calls")) == [10, 10]


def test_merge_goes_on_past_a_damaged_successor_table_and_reports_each_store(tmp_path):
    """Issue 47, case 3: a successor table's blob stored as TEXT ended `specx merge` with a
    TypeError traceback: the stores after it were not merged, and no --json came out."""
    from specx.core.index.successors import SuccessorTable
    from specx.store.successors import save_table, table_key

    with Store(tmp_path / "a.db") as a:
        served(a, "cmpl-a", "SELECT 'a'", [1, 2])
    with Store(tmp_path / "bad.db") as bad:
        served(bad, "cmpl-bad", "SELECT 'bad'", [5, 6])
        save_table(bad, table_key("m", "fp-served"), SuccessorTable(1000, k=2))
        bad.db.execute("UPDATE successors SET blob = 'text, not a blob'")
        bad.db.conn.commit()
    with Store(tmp_path / "b.db") as b:
        served(b, "cmpl-b", "SELECT 'b'", [3, 4])
    res = run("merge", str(tmp_path / "bad.db"), str(tmp_path / "b.db"), "--db", str(tmp_path / "a.db"), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    data = json.loads(res.stdout)
    assert [m["store"] for m in data["merged"]] == [str(tmp_path / "bad.db"), str(tmp_path / "b.db")]
    assert [(s["store"], s["outcome"]) for s in data["stores"]] == [
        (str(tmp_path / "bad.db"), "merged in part"), (str(tmp_path / "b.db"), "merged")]
    assert data["errors"] == [f"{tmp_path / 'bad.db'}: the successor table of m|fp-served is damaged: its blob is "
                              f"stored as TEXT: not merged"]
    with Store(tmp_path / "a.db") as a:
        assert a.db.execute("SELECT count(*) FROM calls").fetchone()[0] == 3  # the calls of both are merged
