"""`--tenant` of ingest, merge, entropy and replay on real SQLite files: a tenant's history is its
own (two tenants ingesting or merging the same logs hold two histories), and one tenant's outputs
never draft another tenant's calls."""

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import specx_in_process
from specx.store.db import Store, content_key
from specx.store.ingest import ingest
from specx.store.merge import merge
from specx.store.selection import outside_sessions, select_calls
from specx.store.tenants import PUBLIC, source_key, tenants_in

from helpers.logs import write_pairs


def secrets(path: Path, n: int = 6, seed: int = 0, grow: int = 0) -> Path:
    """A {prompt, completion} log whose outputs are random words (nothing but the same outputs
    elsewhere predicts them); `grow`: that many more lines after the same n."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n + grow):
            secret = " ".join(rng.choice(words, size=40))
            f.write(json.dumps({"prompt": f"What is the key of service {i}?", "completion": secret}) + "\n")
    return path


def cli(*args: str) -> tuple[int, dict | None, str]:
    res = specx_in_process(*args)
    try:
        data = json.loads(res.stdout) if res.stdout.strip() else None
    except json.JSONDecodeError:
        data = None
    return res.returncode, data, res.stderr


def rows(db: Path, sql: str, args=()) -> list[tuple]:
    with Store(db, readonly=True) as store:
        return [tuple(r) for r in store.db.execute(sql, list(args))]


def per_tenant(db: Path) -> dict[str, tuple[int, int, int, int]]:
    """tenant -> (sources, sessions, calls, token rows)."""
    return {t: (int(a), int(b), int(c), int(d)) for t, a, b, c, d in rows(
        db, "SELECT src.tenant, count(DISTINCT src.id), count(DISTINCT s.id), count(DISTINCT c.id), count(t.call_id)"
            " FROM sources src LEFT JOIN sessions s ON s.source_id = src.id LEFT JOIN calls c ON c.session_id = s.id"
            " LEFT JOIN tokens t ON t.call_id = c.id GROUP BY src.tenant")}


def test_the_same_log_for_two_tenants_is_two_histories(tmp_path, tokenizer):  # noqa: F811
    tokenizer.get()
    log, db = secrets(tmp_path / "logs" / "run.jsonl"), tmp_path / "t.db"
    for tenant, new in (("a", 6), ("b", 6), ("a", 0), ("", 6), ("b", 0), ("", 0)):
        code, data, err = cli("ingest", str(log), "--db", str(db), "--json", *(["--tenant", tenant] if tenant else []))
        assert code == 0, err
        assert (data["calls"], data["new_calls"], data["skipped_files"]) == (6, new, 0 if new else 1), tenant
    assert per_tenant(db) == {"": (1, 6, 6, 6), "a": (1, 6, 6, 6), "b": (1, 6, 6, 6)}
    sha = rows(db, "SELECT DISTINCT sha256 FROM sources")[0][0]
    keys = dict((t, k) for t, k in rows(db, "SELECT tenant, key FROM sources"))
    assert keys == {t: source_key("jsonl-pairs", sha, t) for t in ("", "a", "b")}
    assert keys[""] == content_key("jsonl-pairs", sha)  # the default tenant's key is the one before tenants
    assert len({k for (k,) in rows(db, "SELECT key FROM sessions")}) == 18  # no session shared between tenants
    # the file grows: each tenant's stored calls are recognised in its own history, the new line added
    secrets(log, grow=1)
    for tenant in ("a", "b"):
        code, data, err = cli("ingest", str(log), "--db", str(db), "--tenant", tenant, "--json")
        assert code == 0 and (data["new_calls"], data["duplicate_calls"]) == (1, 6), (tenant, err)
    assert per_tenant(db) == {"": (1, 6, 6, 6), "a": (2, 7, 7, 7), "b": (2, 7, 7, 7)}
    res = specx_in_process("ls", "--db", str(db), "--json")
    assert res.returncode == 0 and set(json.loads(res.stdout)["tenants"]) == {"", "a", "b"}
    res = specx_in_process("ls", "--db", str(db))
    assert res.returncode == 0 and "(default)" in res.stdout


def test_ls_names_tenants_only_where_there_are_some(tmp_path, tokenizer):  # noqa: F811
    with Store(tmp_path / "t.db") as store:
        ingest(store, [write_pairs(tmp_path / "pairs.jsonl")], tokenizer)
        assert tenants_in(store) == {"": 6}
    res = specx_in_process("ls", "--db", str(tmp_path / "t.db"))
    assert res.returncode == 0 and "(default)" not in res.stdout and "totals" in res.stdout


def test_a_bad_tenant_name_is_a_usage_error_and_stores_nothing(tmp_path, tokenizer):  # noqa: F811
    log, db = write_pairs(tmp_path / "pairs.jsonl"), tmp_path / "t.db"
    for name in ("a b", "../etc", "é", "-a", "x" * 65, ".hidden"):
        res = specx_in_process("ingest", str(log), "--db", str(db), f"--tenant={name}")
        assert res.returncode == 2 and "--tenant" in res.stderr and "Traceback" not in res.stderr, (name, res.stderr)
        assert not db.exists()
    with Store(db) as store:
        ingest(store, [log], tokenizer)
    for command in (["merge", str(tmp_path / "other.db")], ["entropy", "--no-predict"], ["replay", "--no-project"]):
        res = specx_in_process(*command, "--db", str(db), "--tenant", "no/such")
        assert res.returncode == 2 and "--tenant" in res.stderr and "letters, digits" in res.stderr, res.stderr
    with pytest.raises(ValueError, match="tenant name"):
        with Store(db) as store:
            ingest(store, [log], tokenizer, tenant="a b")
    assert per_tenant(db) == {"": (1, 6, 6, 6)}


def test_merge_into_a_tenant(tmp_path, tokenizer):  # noqa: F811
    log = secrets(tmp_path / "logs" / "run.jsonl")
    other_log = secrets(tmp_path / "logs" / "other.jsonl", seed=1)
    with Store(tmp_path / "replica.db") as replica:  # the default tenant's and tenant c's
        ingest(replica, [log], tokenizer)
        ingest(replica, [other_log], tokenizer, tenant="c")
    db = tmp_path / "central.db"
    code, data, err = cli("merge", str(tmp_path / "replica.db"), "--db", str(db), "--tenant", "a", "--json")
    assert code == 0 and data["merged"][0]["new_calls"] == 12, err
    assert per_tenant(db) == {"a": (2, 12, 12, 12)}
    sha = rows(db, "SELECT sha256 FROM sources WHERE path = ?", [str(log)])[0][0]
    assert rows(db, "SELECT tenant FROM sources WHERE key = ?", [source_key("jsonl-pairs", sha, "a")]) == [("a",)]
    # what tenant a merged is its history: ingesting the file for a finds it; again, merging adds nothing
    with Store(db) as store:
        again = ingest(store, [log], tokenizer, tenant="a")
        assert (again.new_calls, again.skipped_files) == (0, 1)
        with Store(tmp_path / "replica.db", readonly=True) as replica:
            assert merge(store, replica, tenant="a").new_calls == 0
            into_b = merge(store, replica, tenant="b")
            assert (into_b.new_calls, into_b.new_sources, into_b.known_calls) == (12, 2, 0)
    assert per_tenant(db) == {"a": (2, 12, 12, 12), "b": (2, 12, 12, 12)}
    calls = {t: {k for (k,) in rows(db, "SELECT c.key FROM calls c JOIN sessions s ON s.id = c.session_id JOIN"
                                        " sources src ON src.id = s.source_id WHERE src.tenant = ?", [t])}
             for t in ("a", "b")}
    assert len(calls["a"]) == len(calls["b"]) == 12 and not calls["a"] & calls["b"]
    # the index holds every tenant's outputs (what a tenant drafts from is chosen when reading)
    assert rows(db, "SELECT num_calls FROM indexes") == [(24,)]
    # without --tenant, each source keeps its own
    code, data, err = cli("merge", str(tmp_path / "replica.db"), "--db", str(tmp_path / "copy.db"), "--json")
    assert code == 0, err
    assert per_tenant(tmp_path / "copy.db") == {"": (1, 6, 6, 6), "c": (1, 6, 6, 6)}
    assert sorted(rows(tmp_path / "copy.db", "SELECT key FROM sources")) == sorted(
        rows(tmp_path / "replica.db", "SELECT key FROM sources"))


def test_merge_keeps_tenants_apart_when_a_key_does_not_say_the_tenant(tmp_path, tokenizer):  # noqa: F811
    """A source key that another tenant holds in the store merged into (a key made without the
    tenant in it): the merged source, sessions and calls stay in their own tenant's rows."""
    log = secrets(tmp_path / "logs" / "run.jsonl")
    with Store(tmp_path / "dest.db") as dest:
        ingest(dest, [log], tokenizer, tenant="x")
        held = dest.db.execute("SELECT key FROM sources").fetchone()[0]
    with Store(tmp_path / "src.db") as src:
        ingest(src, [log], tokenizer, tenant="y")
        src.db.execute("UPDATE sources SET key = ?", [held])
        src.db.conn.commit()
    for _ in range(2):
        with Store(tmp_path / "dest.db") as dest, Store(tmp_path / "src.db", readonly=True) as src:
            merge(dest, src)
        assert per_tenant(tmp_path / "dest.db") == {"x": (1, 6, 6, 6), "y": (1, 6, 6, 6)}


def before_tenants(db: Path) -> None:
    """Make `db` a store as specx wrote it before tenants (schema m002: no tenant column)."""
    with sqlite3.connect(db) as conn:
        conn.executescript("DROP INDEX sources_tenant; ALTER TABLE sources DROP COLUMN tenant;"
                           " DELETE FROM _sqlite_migrations WHERE name = 'm003_tenants'; PRAGMA user_version = 2;")
    conn.close()


def test_a_store_from_before_tenants(tmp_path, tokenizer):  # noqa: F811
    """Read-only (a merge's other store) it is not migrated: its sources are the default tenant's.
    Migrated, they are the default tenant's, and ingesting the same logs again adds nothing."""
    log = secrets(tmp_path / "logs" / "run.jsonl")
    with Store(tmp_path / "old.db") as old:
        ingest(old, [log], tokenizer)
    before_tenants(tmp_path / "old.db")
    with Store(tmp_path / "new.db") as new, Store(tmp_path / "old.db", readonly=True) as old:
        assert "tenant" not in {r[1] for r in old.db.execute("PRAGMA table_info(sources)")}
        assert merge(new, old).new_calls == 6
        assert merge(new, old, tenant="a").new_calls == 6
        assert merge(new, old, tenant="a").new_calls == merge(new, old).new_calls == 0
    assert per_tenant(tmp_path / "new.db") == {"": (1, 6, 6, 6), "a": (1, 6, 6, 6)}
    with Store(tmp_path / "old.db") as old:
        report = ingest(old, [log], tokenizer)
        assert (report.new_calls, report.skipped_files) == (0, 1)
        assert ingest(old, [log], tokenizer, tenant="a").new_calls == 6
    assert per_tenant(tmp_path / "old.db") == {"": (1, 6, 6, 6), "a": (1, 6, 6, 6)}


@pytest.fixture
def shared(tmp_path, tokenizer):  # noqa: F811
    """Tenant a's log; tenant b's, holding the same outputs (a's secrets, which b learned); a
    public corpus of other outputs; and a store with a alone for comparison."""
    a_log = secrets(tmp_path / "team-a" / "run.jsonl")
    b_log = shutil.copy(a_log, tmp_path / "team-b.jsonl")
    public_log = secrets(tmp_path / "public" / "docs.jsonl", n=3, seed=7)
    with Store(tmp_path / "shared.db") as store:
        ingest(store, [a_log], tokenizer, tenant="a")
        ingest(store, [Path(b_log)], tokenizer, tenant="b")
        ingest(store, [public_log], tokenizer, tenant=PUBLIC)
    with Store(tmp_path / "alone.db") as store:
        ingest(store, [a_log], tokenizer, tenant="a")
    return tmp_path


def test_selection_by_tenant(shared):
    with Store(shared / "shared.db", readonly=True) as store:
        tid = store.tokenizer_id(name="smollm2-135m")
        assert len(select_calls(store, tid)) == 15
        a = select_calls(store, tid, tenants=["a"])
        assert len(a) == 6 and {c.source for c in a} == {str(shared / "team-a" / "run.jsonl")}
        assert len(select_calls(store, tid, tenants=["a", PUBLIC])) == 9
        assert select_calls(store, tid, tenants=["nobody"]) == select_calls(store, tid, tenants=[]) == []
        assert len(outside_sessions(store, tid, a[:2], tenants=["a", PUBLIC])) == 4 + 3
        assert len(outside_sessions(store, tid, a[:2])) == 4 + 6 + 3


def replay(db: Path, *args: str) -> dict:
    code, data, err = cli("replay", "--db", str(db), "--no-baselines", "--no-project", "--json", *args)
    assert code == 0, err
    return data


def test_replay_drafts_a_tenants_calls_from_its_history_alone(shared):
    alone = replay(shared / "alone.db", "--tenant", "a")
    tenant_a = replay(shared / "shared.db", "--tenant", "a")
    assert tenant_a["overall"] == {**alone["overall"], **{k: tenant_a["overall"][k] for k in (
        "draft_us_per_token", "update_us_per_token")}}
    assert tenant_a["overall"]["calls"] == 6 and tenant_a["params"]["tenant"] == "a"
    # --warm pre-loads a's other sessions and the public corpus, never b's (which holds a's outputs)
    warm_a = replay(shared / "shared.db", "--tenant", "a", "--warm", "--session", "line-1", "--session", "line-2")
    assert warm_a["params"]["warm_outputs"] == 6 - 2 + 3
    leaky = replay(shared / "shared.db", "--source", "team-a", "--warm", "--session", "line-1", "--session", "line-2")
    assert leaky["params"]["warm_outputs"] == 6 - 2 + 6 + 3  # every tenant's: b's copies of a's outputs
    assert leaky["overall"]["calls"] == warm_a["overall"]["calls"] == 2
    assert leaky["overall"]["tokens_per_step"] > 2 * warm_a["overall"]["tokens_per_step"]
    # b's replay without a tenant learns a's outputs first (a's sessions come first); with --tenant b it cannot
    everyone = replay(shared / "shared.db", "--by", "source")
    b_alone = replay(shared / "shared.db", "--tenant", "b")
    by_source = {g["key"]: g for g in everyone["groups"]}
    assert b_alone["overall"]["calls"] == 6
    assert by_source[str(shared / "team-b.jsonl")]["tokens_per_step"] > 2 * b_alone["overall"]["tokens_per_step"]
    assert b_alone["overall"]["tokens_per_step"] == pytest.approx(alone["overall"]["tokens_per_step"])


def test_entropy_counts_one_tenants_calls(shared):
    def entropy(*args):
        code, data, err = cli("entropy", "--db", str(shared / "shared.db"), "--json", *args)
        assert code == 0, err
        return data

    everyone, a = entropy("--no-predict"), entropy("--no-predict", "--tenant", "a")
    with Store(shared / "shared.db", readonly=True) as store:
        tid = store.tokenizer_id(name="smollm2-135m")
        a_tokens = sum(len(store.call_tokens(c.id, tid)) for c in select_calls(store, tid, tenants=["a"]))
    assert (everyone["overall"]["calls"], a["overall"]["calls"]) == (15, 6)
    assert a["overall"]["tokens"] == a_tokens < everyone["overall"]["tokens"]
    assert entropy("--no-predict", "--tenant", PUBLIC)["overall"]["calls"] == 3
    predicted = entropy("--tenant", "b", "--sample-calls", "6")
    assert predicted["prediction"]["calls"] == 6 and predicted["overall"]["calls"] == 6
    res = specx_in_process("entropy", "--db", str(shared / "shared.db"), "--no-predict", "--tenant", "nobody")
    assert res.returncode == 2 and "no stored call" in res.stderr
