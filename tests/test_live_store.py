"""The live, tenant-scoped store without a server: core/serve/scopes.py (whose history drafts whose
request), store/watch.py (the store followed while serving) and store/tenants.py (corpora).
Real SQLite files; the server's side is tests/test_serve_tenants.py."""

import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np

from specx.core.decode.speculate import SuffixDrafter
from specx.core.index.suffix_index import SuffixIndex
from specx.core.serve.scopes import Scopes, ScopedDrafter
from specx.store.db import Store, StoreError
from specx.store.formats import Call
from specx.store.served import record_served
from specx.store.tenants import add_corpus, list_corpora, remove_corpus, token_rows
from specx.store.watch import StoreWatcher, load_scopes

TOKENIZER = ("fp", "tok", 1000)


def _served(store, tenant, tokens, session):
    return record_served(store, "m", [Call(session_id=session, position=0, output_text="x", prompt_text="p")],
                         [tokens], "fp", "tok", 1000, tenant=tenant)


def test_a_tenant_drafts_from_its_own_rows_and_the_public_ones_only():
    scopes = Scopes({"a": SuffixIndex(), "b": SuffixIndex()}, tenants=True)
    scopes.offer([(1, "a", [5, 6, 7, 8]), (2, "b", [9, 10, 11, 12]), (3, "public", [20, 21, 22]),
                  (4, "", [30, 31, 32]), (5, "c", [40, 41, 42])])  # '' and c: no configured tenant's
    scopes.apply()
    a, b = scopes.index("a"), scopes.index("b")
    assert (a.count([5, 6]), a.count([9, 10]), a.count([20, 21]), a.count([30, 31]), a.count([40, 41])) == (1, 0, 1, 0, 0)
    assert (b.count([5, 6]), b.count([9, 10]), b.count([20, 21])) == (0, 1, 1)
    drafter = ScopedDrafter(SuffixDrafter(SuffixIndex()), scopes, "a")
    drafter.start_request([1, 5, 6])
    assert drafter.speculate().token_ids == [7, 8]
    drafter.extend([7, 8, 99])
    drafter.finish_request()  # what a's request teaches goes into a's index alone
    assert scopes.index("a").count([8, 99]) == 1 and scopes.index("b").count([8, 99]) == 0
    b_drafter = ScopedDrafter(SuffixDrafter(SuffixIndex()), scopes, "b")
    b_drafter.start_request([1, 5, 6])
    assert b_drafter.speculate().token_ids == []  # b never drafts a's history


def test_without_tenants_one_scope_takes_every_row_and_rows_learned_are_not_added_twice():
    index = SuffixIndex()
    scopes = Scopes({"": index}, tenants=False)
    index.add([1, 2, 3])  # learned by the drafter, then stored as row 7
    scopes.learned("", [7])
    scopes.offer([(7, "", [1, 2, 3]), (8, "b", [4, 5])])
    scopes.apply()
    assert index.count([1, 2, 3]) == 1 and index.count([4, 5]) == 1


def test_a_rebuilt_index_is_swapped_in_and_rows_it_holds_are_not_added_again():
    scopes = Scopes({"": SuffixIndex()}, tenants=False)
    scopes.replace("", SuffixIndex.build([[1, 2, 3]]), upto_rowid=10)
    scopes.offer([(9, "", [1, 2, 3]), (11, "", [4, 5, 6])])
    scopes.apply()
    assert scopes.index("").count([1, 2, 3]) == 1 and scopes.index("").count([4, 5, 6]) == 1
    assert scopes.rebuilds == 1


def test_a_large_backlog_is_added_a_budget_per_step():
    scopes = Scopes({"": SuffixIndex()}, tenants=False)
    scopes.offer([(i, "", list(range(100))) for i in range(1, 11)])
    assert scopes.apply(budget=250) == 200 and scopes.pending_tokens() == 800
    while scopes.pending_tokens():
        scopes.apply(budget=250)
    assert scopes.index("").num_tokens == 1000


def test_the_watcher_hands_over_new_rows_and_rebuilds_when_rows_go_away(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as store:
        _served(store, "a", [1, 2, 3, 4], "s1")
        add_corpus(store, "b", "docs", ["doc"], [[7, 8, 9, 10]], TOKENIZER)
        scopes, count, last = load_scopes(store, "fp", ["a", "b"])
    assert scopes.index("a").count([1, 2]) == 1 and scopes.index("b").count([7, 8]) == 1
    assert scopes.index("a").count([7, 8]) == 0
    watcher = StoreWatcher(db, "fp", scopes, count=count, last=last)
    with Store(db, readonly=True) as reader:
        watcher.poll(reader)  # nothing new
        assert scopes.pending_tokens() == 0
        with Store(db) as writer:  # another process writes: a new corpus for a
            add_corpus(writer, "a", "more", ["x"], [[11, 12, 13]], TOKENIZER)
        watcher.poll(reader)
        scopes.apply()
        assert scopes.index("a").count([11, 12, 13]) == 1 and scopes.index("b").count([11, 12]) == 0
        with Store(db) as writer:
            assert remove_corpus(writer, "b", "docs")
        done = watcher.rebuild(["b"])
        watcher.poll(reader)
        assert done.is_set()
        scopes.apply()
        assert scopes.index("b").count([7, 8]) == 0 and scopes.index("a").count([1, 2]) == 1


def test_rows_going_away_rebuild_only_the_scopes_they_drafted_in(tmp_path):
    """Issue 59, hole 9: one tenant's corpus removal rebuilt every tenant's index (another
    tenant's stream stalled while it ran). Now only the scopes that drafted from the removed rows
    are rebuilt: b's for b's corpus, every scope for a public one."""
    db = tmp_path / "s.db"
    with Store(db) as store:
        _served(store, "a", [1, 2, 3, 4], "s1")
        add_corpus(store, "b", "docs", ["doc"], [[7, 8, 9, 10]], TOKENIZER)
        add_corpus(store, "public", "shared", ["all"], [[20, 21, 22]], TOKENIZER)
        scopes, count, last = load_scopes(store, "fp", ["a", "b"])
    watcher = StoreWatcher(db, "fp", scopes, count=count, last=last)
    a_index = scopes.index("a")
    with Store(db, readonly=True) as reader:
        watcher.poll(reader)
        with Store(db) as writer:  # another process removes b's corpus and adds one for a
            assert remove_corpus(writer, "b", "docs")
            add_corpus(writer, "a", "more", ["x"], [[11, 12, 13]], TOKENIZER)
        watcher.poll(reader)
        scopes.apply()
        assert scopes.rebuilds == 1 and scopes.index("a") is a_index  # b's alone
        assert scopes.index("b").count([7, 8]) == 0 and scopes.index("b").count([20, 21]) == 1
        assert scopes.index("a").count([11, 12, 13]) == 1 and scopes.index("a").count([1, 2]) == 1
        with Store(db) as writer:
            assert remove_corpus(writer, "public", "shared")
        watcher.poll(reader)
        scopes.apply()
        assert scopes.rebuilds == 3 and all(scopes.index(t).count([20, 21]) == 0 for t in "ab")
        assert scopes.index("a").count([11, 12, 13]) == 1


def test_corpora_round_trip_and_removal_leaves_nothing_of_them(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as store:
        _served(store, "b", [50, 51], "s")
        info = add_corpus(store, "b", "docs", ["alpha beta", "gamma"], [[1, 2], [3]], TOKENIZER)
        assert (info["name"], info["texts"], info["tokens"]) == ("docs", 2, 3)
        add_corpus(store, "b", "docs", ["delta"], [[4, 5, 6]], TOKENIZER)  # the same name: replaced
        assert [(c["name"], c["tokens"]) for c in list_corpora(store, "b")] == [("docs", 3)]
        assert list_corpora(store, "a") == []  # another tenant's are not listed
        tid = store.tokenizer_id("fp")
        assert sorted(r.tokens.tolist() for r in token_rows(store, tid, tenants=["b"])) == [[4, 5, 6], [50, 51]]
        assert not remove_corpus(store, "a", "docs")  # a cannot remove b's
        assert remove_corpus(store, "b", "docs")
        assert [r.tokens.tolist() for r in token_rows(store, tid)] == [[50, 51]]
        assert store.db.execute("SELECT count(*) FROM calls c JOIN sessions s ON s.id = c.session_id"
                                " WHERE s.format = 'corpus'").fetchone()[0] == 0
        packs = [store.read(p, 0, n) for p, n in store.db.execute("SELECT id, raw_bytes FROM packs")]
        assert not any(b"delta" in data or np.int32(4).tobytes() + np.int32(5).tobytes() in data for data in packs)


def test_a_killed_writer_leaves_the_store_whole_and_the_watcher_sees_all_of_it(tmp_path):
    """kill -9 in the middle of writing corpora: each is all in or all out, and what a watcher
    rebuilds from the store is exactly its rows."""
    db = tmp_path / "s.db"
    script = textwrap.dedent(f"""
        from specx.store.db import Store, StoreError
        from specx.store.tenants import add_corpus
        with Store({str(db)!r}) as store:
            for i in range(100000):
                add_corpus(store, "a", f"c{{i}}", ["t"] * 50, [[i % 900 + 1] * 40] * 50, ("fp", "tok", 1000))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 300  # a fresh interpreter's imports may take a while on a busy machine
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with Store(db, readonly=True) as store:
                    if len(list_corpora(store, "a")) >= 2:
                        break
            except (StoreError, sqlite3.Error):  # not made yet, or its schema half written
                pass
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL, in the middle of the next corpus
        proc.wait()
    with Store(db) as store:
        corpora = list_corpora(store, "a")
        assert corpora and all(c["texts"] == 50 and c["tokens"] == 2000 for c in corpora)
        scopes, count, last = load_scopes(store, "fp", ["a"])
        assert scopes.index("a").num_tokens == 2000 * len(corpora) == sum(
            len(r.tokens) for r in token_rows(store, store.tokenizer_id("fp")))
