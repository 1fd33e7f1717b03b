"""The successor table (core/index/successors.py) and the hybrid drafter (core/decode/hybrid.py)."""

import numpy as np
import pytest
import torch

from specx.core.decode.hybrid import HybridDrafter
from specx.core.decode.speculate import SuffixDrafter
from specx.core.draft import GLOBAL, REQUEST, TABLE
from specx.core.index.successors import SuccessorTable, SuccessorTableError
from specx.core.index.suffix_index import SuffixIndex


def test_learn_keeps_each_tokens_last_row():
    table = SuccessorTable(10, k=2)
    table.learn([3, 4, 3, 99, -1], [[1, 2], [5, 6], [7, 8], [1, 1], [1, 1]], [[0.5, 0.4]] * 5)
    assert table.next[3].tolist() == [7, 8]  # the later row of token 3
    assert table.next[4].tolist() == [5, 6]
    assert len(table) == 2 and table.rows_learned == 2  # 99 and -1 are not tokens of this vocabulary


def test_draft_is_best_first_by_path_probability():
    table = SuccessorTable(10, k=3)
    table.learn([1, 2, 3], [[2, 3, 4], [5, 6, 7], [8, 9, 0]], [[0.5, 0.3, 0.1], [0.9, 0.05, 0.01], [0.2, 0.1, 0.1]])
    draft = table.draft(1, max_nodes=4)
    # 2 (0.5), then 5 after 2 (0.45), 3 (0.3), 4 (0.1) beats 8 after 3 (0.06)
    assert draft.token_ids == [2, 5, 3, 4] and draft.parents == [-1, 0, -1, -1]
    assert draft.probs == pytest.approx([0.5, 0.45, 0.3, 0.1], abs=1e-3)
    assert draft.probs == sorted(draft.probs, reverse=True)
    assert table.draft(1, max_nodes=10, min_prob=0.2).token_ids == [2, 5, 3]
    assert len(table.draft(7, max_nodes=4)) == 0 and len(table.draft(-1, max_nodes=4)) == 0


def test_merge_takes_the_most_likely_of_both_entries():
    a, b = SuccessorTable(10, k=2), SuccessorTable(10, k=2)
    a.learn([1, 2], [[3, 4], [5, 6]], [[0.6, 0.2], [0.5, 0.1]])
    b.learn([1, 7], [[4, 8], [9, 2]], [[0.7, 0.1], [0.8, 0.1]])
    a.merge(b)
    assert a.next[1].tolist() == [4, 3] and a.next[2].tolist() == [5, 6] and a.next[7].tolist() == [9, 2]
    with pytest.raises(ValueError, match="12 and 10 tokens"):
        a.merge(SuccessorTable(12))


def test_bytes_round_trip_and_damage():
    table = SuccessorTable(10, k=2)
    table.learn([1], [[2, 3]], [[0.5, 0.25]])
    again = SuccessorTable.from_bytes(table.to_bytes(), vocab_size=10)
    assert np.array_equal(again.next, table.next) and np.array_equal(again.prob, table.prob)
    with pytest.raises(SuccessorTableError, match="header"):
        SuccessorTable.from_bytes(b"garbage")
    with pytest.raises(SuccessorTableError, match="for a vocabulary of 10 tokens, the model has 12"):
        SuccessorTable.from_bytes(table.to_bytes(), vocab_size=12)
    with pytest.raises(SuccessorTableError, match="damaged"):
        SuccessorTable.from_bytes(table.to_bytes()[:40])


def test_hybrid_adds_the_table_only_below_tau():
    index = SuffixIndex.build([[5, 6, 7, 8, 9]])
    table = SuccessorTable(20, k=2)
    table.learn([6, 12], [[11, 12], [13, 14]], [[0.6, 0.3], [0.9, 0.1]])
    drafter = HybridDrafter(SuffixDrafter(index), table, tau=100.0)
    drafter.start_request([1, 5, 6])
    draft = drafter.speculate()
    suffix_tokens = SuffixDrafter(index)
    suffix_tokens.start_request([1, 5, 6])
    plain = suffix_tokens.speculate()
    assert draft.token_ids[: len(plain)] == plain.token_ids  # the suffix tree's nodes first
    assert set(draft.token_ids[len(plain):]) == {11, 12, 13, 14}
    assert all(s & TABLE for s in draft.sources[len(plain):])
    assert all(s & (REQUEST | GLOBAL) and not s & TABLE for s in draft.sources[: len(plain)])
    high = HybridDrafter(SuffixDrafter(index), table, tau=0.0)
    high.start_request([1, 5, 6])
    assert high.speculate().token_ids == plain.token_ids  # a tree that scores >= tau goes alone
    alone = HybridDrafter(None, table)
    alone.start_request([6])
    alone.extend([12])  # the context's last token is now 12
    assert alone.speculate().token_ids[:1] == [13]


def test_the_table_goes_on_where_the_suffix_trees_paths_end():
    index = SuffixIndex.build([[5, 6, 7, 8]])
    table = SuccessorTable(20, k=1)
    table.learn([8, 10], [[10], [11]], [[0.9], [0.5]])
    drafter = HybridDrafter(SuffixDrafter(index), table, leaves=True)
    drafter.start_request([1, 5, 6])
    draft = drafter.speculate()
    plain = SuffixDrafter(index)
    plain.start_request([1, 5, 6])
    path = plain.speculate()
    assert path.token_ids == [7, 8]
    leaf = draft.token_ids.index(8)
    tail = draft.token_ids.index(10)
    assert draft.parents[tail] == leaf and draft.parents[draft.token_ids.index(11)] == tail
    assert draft.probs[tail] == pytest.approx(draft.probs[leaf] * 0.9, rel=1e-3) and draft.sources[tail] == TABLE
    root_only = HybridDrafter(SuffixDrafter(index), table, leaves=False)
    root_only.start_request([1, 5, 6])
    assert 10 not in root_only.speculate().token_ids  # nothing follows 6 in the table


def test_a_linear_verifier_gets_the_path_verification_rates_best():
    """On llama.cpp (linear drafts) the hybrid's tree is cut to one path. The table's D is the model's
    own probability and a long chain of it outsums the suffix path's D; once the acceptance model has
    seen table nodes rejected and suffix nodes accepted, the path is the suffix one."""
    from types import SimpleNamespace

    from specx.core.cost.acceptance import AcceptanceModel
    from specx.core.decode.loop import shape_draft

    index = SuffixIndex.build([[5, 6, 7, 8, 9]] * 3)
    table = SuccessorTable(20, k=1)
    table.learn([6, 11, 12, 13], [[11], [12], [13], [14]], [[0.95], [0.95], [0.95], [0.95]])
    drafter = HybridDrafter(SuffixDrafter(index), table)
    drafter.start_request([1, 5, 6])
    draft = drafter.speculate()
    linear = SimpleNamespace(linear=True, vocab_size=20)
    assert shape_draft(draft, linear).token_ids == [11, 12, 13, 14]  # by D alone: the table's chain
    acceptance = AcceptanceModel()
    suffix_path = [i for i, s in enumerate(draft.sources) if not s & TABLE]
    for _ in range(50):
        acceptance.update(draft, suffix_path)  # verification: the suffix path accepted, the table's root not
    assert shape_draft(draft, linear, acceptance=acceptance).token_ids == [draft.token_ids[i] for i in suffix_path]
    assert [draft.token_ids[i] for i in suffix_path][:1] == [7]


def test_kept_in_the_store_and_merged(tmp_path):
    from specx.store.db import Store, StoreError
    from specx.store.merge import merge
    from specx.store.successors import load_table, save_table, table_key

    key = table_key("tiny", "fp")
    a, b = Store(tmp_path / "a.db"), Store(tmp_path / "b.db")
    assert load_table(a, key, 10) is None
    mine, theirs = SuccessorTable(10, k=2), SuccessorTable(10, k=2)
    mine.learn([1], [[2, 3]], [[0.6, 0.2]])
    theirs.learn([1, 4], [[3, 5], [6, 7]], [[0.7, 0.1], [0.5, 0.4]])
    save_table(a, key, mine)
    save_table(b, key, theirs)
    save_table(b, table_key("other", "fp"), theirs)
    report = merge(a, b)
    assert report.successor_tables == [table_key("other", "fp"), key]
    merged = load_table(a, key, 10)
    assert merged.next[1].tolist() == [3, 2] and merged.next[4].tolist() == [6, 7]
    assert load_table(a, table_key("other", "fp"), 10).next[4].tolist() == [6, 7]
    with pytest.raises(StoreError, match="vocabulary of 10 tokens, the model has 12"):
        load_table(a, key, 12)
    a.db.execute("UPDATE successors SET blob = ? WHERE model = ?", [b"\x28\xb5\x2f\xfd garbage", key])
    a.db.conn.commit()
    with pytest.raises(StoreError, match=r"successor table of tiny\|fp is damaged"):
        load_table(a, key, 10)


def _npz_table(arrays, compression=None):
    """A kept table's bytes around hand-made npz members: {name: (npy header dict, data bytes)}."""
    import io
    import zipfile

    from specx.core.index.successors import _MAGIC

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression or zipfile.ZIP_STORED) as archive:
        for name, (header, data) in arrays.items():
            npy = io.BytesIO()
            np.lib.format.write_array_header_1_0(npy, header)
            archive.writestr(f"{name}.npy", npy.getvalue() + data)
    return _MAGIC + out.getvalue()


def test_a_hostile_kept_table_is_refused_before_anything_is_allocated():
    """Issue 47, case 3: a 212-byte blob declaring (10^9, 8) took 29.8 GiB; k = 0 was a ValueError
    traceback; a 597-byte blob holding (49152, 4096), deflated inside, was accepted (1.6 -> 3.9 GB)."""
    import zipfile

    def header(shape, dtype):
        return {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": shape}

    huge = _npz_table({"next": (header((10**9, 8), "<i4"), b""), "prob": (header((10**9, 8), "<f2"), b"")})
    assert len(huge) < 1000
    with pytest.raises(SuccessorTableError, match="vocabulary of 1,000,000,000 tokens, the model has 49,152"):
        SuccessorTable.from_bytes(huge, vocab_size=49152)
    with pytest.raises(SuccessorTableError, match="not 1 to 1,048,576"):
        SuccessorTable.from_bytes(huge)
    k0 = _npz_table({"next": (header((10, 0), "<i4"), b""), "prob": (header((10, 0), "<f2"), b"")})
    with pytest.raises(SuccessorTableError, match="damaged: it keeps 0 successors per token"):
        SuccessorTable.from_bytes(k0, vocab_size=10)
    wide = _npz_table({"next": (header((100, 4096), "<i4"), bytes(100 * 4096 * 4)),
                       "prob": (header((100, 4096), "<f2"), bytes(100 * 4096 * 2))}, zipfile.ZIP_DEFLATED)
    assert len(wide) < 10_000  # zeros deflate to almost nothing: the bound on the zstd frame never sees them
    with pytest.raises(SuccessorTableError, match="damaged: its next array is compressed inside"):
        SuccessorTable.from_bytes(wide, vocab_size=100)
    objects = _npz_table({"next": (header((10, 2), "|O"), b""), "prob": (header((10, 2), "<f2"), b"")})
    with pytest.raises(SuccessorTableError, match="damaged: its next array is object"):
        SuccessorTable.from_bytes(objects, vocab_size=10)
    with pytest.raises(SuccessorTableError, match="not a specx successor table"):
        SuccessorTable.from_bytes("text, not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("damage", ["text", "integer", "huge", "k0"])
def test_a_damaged_table_row_is_said_and_a_new_table_started(tmp_path, damage):
    """Issue 47, case 3: a `blob` stored as TEXT or INTEGER was a TypeError traceback in generate,
    serve and merge; now it is "damaged", a new table starts, and merge goes on."""
    from specx.stack import kept_table
    from specx.store import codec
    from specx.store.db import Store
    from specx.store.merge import merge
    from specx.store.successors import load_table, save_table, table_key

    key = table_key("tiny", "fp")
    with Store(tmp_path / "bad.db") as bad:
        save_table(bad, key, SuccessorTable(10, k=2))
        header = {"descr": "<i4", "fortran_order": False, "shape": (10**9, 8) if damage == "huge" else (10, 0)}
        plain = {"text": "a table", "integer": 42}
        value = plain[damage] if damage in plain else codec.compress(_npz_table(
            {"next": (header, b""), "prob": (header | {"descr": "<f2"}, b"")}))
        bad.db.execute("UPDATE successors SET blob = ? WHERE model = ?", [value, key])
        bad.db.conn.commit()
        said = []
        assert kept_table(bad, key, 10, said.append) is None
        assert len(said) == 1 and f"successor table of {key} is damaged" in said[0] \
            and said[0].endswith("starting a new successor table")
    with Store(tmp_path / "dest.db") as dest, Store(tmp_path / "bad.db", readonly=True) as src:
        good = SuccessorTable(10, k=2)
        good.learn([1], [[2, 3]], [[0.5, 0.2]])
        save_table(dest, key, good)
        report = merge(dest, src)
        assert report.successor_tables == [] and len(report.damaged) == 1
        assert report.damaged[0].startswith(f"the successor table of {key} is damaged") \
            and report.damaged[0].endswith("not merged")
        assert load_table(dest, key, 10).next[1].tolist() == [2, 3]  # the destination's table is untouched
    with Store(tmp_path / "fresh.db") as fresh, Store(tmp_path / "bad.db") as bad:
        save_table(fresh, key, good)  # the damaged one is the destination's: replaced by the other store's
        report = merge(bad, fresh)
        assert report.successor_tables == [key] and "starting a new table" in report.damaged[0]
        assert str(tmp_path / "bad.db") in report.damaged[0]
        assert load_table(bad, key, 10).next[1].tolist() == [2, 3]


def test_merge_names_the_store_whose_table_is_for_another_vocabulary(tmp_path):
    """Issue 47, case 6: a source's table for 100 tokens gave an error naming the destination ("is
    the table is for a vocabulary of 49152 ..."); into a store with no table it was copied silently
    (rc 0) and discarded at the next start."""
    from specx.store.db import Store
    from specx.store.merge import merge
    from specx.store.successors import load_table, save_table, table_key

    key = table_key("tiny", "fp")
    with Store(tmp_path / "dest.db") as dest, Store(tmp_path / "src.db") as src:
        save_table(dest, key, SuccessorTable(12, k=2))
        save_table(src, key, SuccessorTable(10, k=2))
        report = merge(dest, src)
        assert report.successor_tables == []
        assert report.damaged == [f"the successor table of {key} is for a vocabulary of 10 tokens, "
                                  f"{tmp_path / 'dest.db'}'s of 12: not merged"]
        assert load_table(dest, key, 12) is not None
    with Store(tmp_path / "empty.db") as empty, Store(tmp_path / "src.db") as src:
        with src.db.atomic():
            src.add_tokenizer("fp", "tiny", 12)  # its tokenizer has 12 tokens: a table of 10 is no table of its model
        report = merge(empty, src)
        assert report.successor_tables == [] and "fewer than its tokenizer's 12: not merged" in report.damaged[0]
        assert load_table(empty, key, 10) is None


def _hybrid(vocab_size, index_outputs=()):
    """A hybrid drafter over a suffix index of `index_outputs` and a fresh table (returned too)."""
    table = SuccessorTable(vocab_size)
    return HybridDrafter(SuffixDrafter(SuffixIndex.build([list(o) for o in index_outputs])), table, tau=1e9), table


@pytest.mark.parametrize("alone", [True, False], ids=["table", "hybrid"])
def test_table_drafts_are_lossless_greedy_and_sampled(alone):
    """The table learns from every pass and its trees are verified like any draft: greedy output is
    plain greedy's token for token, seeded sampling the plain sampler's (transformers engine)."""
    from specx.core.decode.generate import generate, greedy_decode
    from specx.core.decode.loop import collect
    from specx.core.decode.request import Decoding
    from specx.core.model.transformers.engine import TransformersEngine
    from helpers.models import VOCAB, tiny_model

    model = tiny_model(torch.float64)
    engine = TransformersEngine(model)
    rng = np.random.default_rng(3)
    drafter, table = _hybrid(VOCAB)
    if alone:
        drafter.inner = None
    prompts = [rng.integers(0, VOCAB, size=6).tolist() for _ in range(3)]
    drafted = 0
    for prompt in prompts * 2:  # the second time round the table has learnt these prompts' passes
        run = collect(generate(engine, prompt, drafter, Decoding(max_new_tokens=40), successors=table))
        assert run.tokens == greedy_decode(model, prompt, 40)
        drafted += run.stats.drafted
    assert len(table) > 20 and drafted > 0
    settings = Decoding(max_new_tokens=40, temperature=0.8, top_k=10, top_p=0.9, seed=5)
    plain = collect(generate(engine, prompts[0], None, settings)).tokens
    spec = collect(generate(engine, prompts[0], drafter, settings, successors=table))
    assert spec.tokens == plain and spec.stats.steps < len(plain)  # drafts were accepted


def test_table_drafts_are_lossless_under_a_grammar(builtin_tokenizer, builtin_vocabulary):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specx.core.decode.generate import generate, greedy_decode
    from specx.core.decode.request import Decoding
    from specx.core.decode.grammar import json_schema_grammar
    from specx.core.decode.loop import collect
    from specx.core.model.transformers.engine import TransformersEngine

    config = LlamaConfig(vocab_size=len(builtin_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval().requires_grad_(False)
    grammar = json_schema_grammar({"type": "object", "properties": {"sql": {"type": "string"}}, "required": ["sql"]})
    eos = builtin_tokenizer.eos_token_id
    drafter, table = _hybrid(len(builtin_tokenizer))
    prompt = builtin_tokenizer.encode("Answer in JSON:")
    want = greedy_decode(model, prompt, 32, eos, builtin_vocabulary.constraint(grammar))
    for _ in range(2):
        out = collect(generate(TransformersEngine(model), prompt, drafter,
                               Decoding(max_new_tokens=32, eos_token_ids=eos),
                               constraint=builtin_vocabulary.constraint(grammar), successors=table)).tokens
        assert out == want
    assert len(table) > 0


@pytest.mark.slow
def test_table_drafts_are_lossless_on_llamacpp(builtin_tokenizer):
    """On llama.cpp (linear drafts: the table's best path), the built-in GGUF writes llama.cpp's own
    greedy tokens with the hybrid drafter, and the table learns from its rows."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")
    from specx.core.decode.generate import generate
    from specx.core.decode.request import Decoding
    from specx.core.decode.loop import collect
    from specx.core.model.llamacpp import LlamaModel, greedy
    from specx.core.model.load import builtin_gguf

    llama = LlamaModel(builtin_gguf("smollm2-135m"), threads=2)
    try:
        eos = builtin_tokenizer.eos_token_id
        drafter, table = _hybrid(llama.vocab_size)
        prompts = [builtin_tokenizer.encode(f"/* Question: {q} */\nSELECT", add_special_tokens=False)
                   for q in ("Names of singers older than 30", "Countries of singers", "Names of singers older than 30")]
        steps = 0
        for prompt in prompts:
            reference = greedy(llama, prompt, 32, [eos])
            run = collect(generate(llama, prompt, drafter, Decoding(max_new_tokens=32, eos_token_ids=eos),
                                   successors=table))
            assert run.tokens == reference
            steps += run.stats.steps
        assert len(table) > 20 and steps < sum(len(greedy(llama, p, 32, [eos])) for p in prompts)
    finally:
        llama.close()


@pytest.mark.slow
def test_generate_keeps_the_table_and_starts_warm_from_it(tmp_path):
    """`specx generate --drafter hybrid` keeps the table its passes taught in the store; the next run
    loads it (warm), and its output stays plain decoding's (--compare)."""
    import json

    from helpers.cli import specx_in_process
    from specx.store.db import Store

    db = tmp_path / "s.db"
    Store(db).close()
    args = ["generate", "SELECT name FROM singer WHERE", "--raw", "--max-tokens", "24", "--db", str(db),
            "--drafter", "hybrid", "--json"]
    first = specx_in_process(*args)
    assert first.returncode == 0, first.stderr
    with Store(db) as store:
        (tokens,) = store.db.execute("SELECT tokens FROM successors").fetchone()
    assert tokens > 10
    second = specx_in_process(*args, "--compare")
    assert second.returncode == 0, second.stderr
    assert f"successor table: {tokens:,} tokens with successors" in second.stderr
    assert json.loads(second.stdout)["identical"] is True
    bad = specx_in_process("generate", "x", "--drafter", "bogus")
    assert bad.returncode == 2 and "choose one of suffix, table, hybrid" in bad.stderr


def test_drafter_choices_the_engines_and_replays_cannot_run_are_refused(tmp_path):
    """--drafter: vLLM drafts from the suffix index only, as does the model-free replay; both refuse the
    table by name (their default is suffix), before any model loads."""
    from helpers.cli import specx_in_process
    from specx.store.db import Store

    with Store(tmp_path / "s.db"):
        pass
    vllm = specx_in_process("serve", "--engine", "vllm", "--drafter", "table")
    assert vllm.returncode == 2 and "inside vLLM specx drafts from its suffix index only" in vllm.stderr
    replay = specx_in_process("replay", "--db", str(tmp_path / "s.db"), "--drafter", "hybrid")
    assert replay.returncode == 2 and "the model-free replay drafts from the suffix index only" in replay.stderr
    assert "Traceback" not in vllm.stderr + replay.stderr


def test_the_hybrid_is_the_default_only_where_trees_are_verified_on_an_accelerator():
    from types import SimpleNamespace

    from specx.stack import default_drafter
    from specx.core.model.transformers.engine import TransformersEngine
    from specx.core.model.llamacpp import LlamaModel
    from helpers.models import tiny_model

    assert default_drafter(SimpleNamespace(tree_unsupported=None, device="cuda")) == "hybrid"
    assert default_drafter(SimpleNamespace(tree_unsupported="linear drafts only", device="cuda")) == "suffix"
    engine = TransformersEngine(tiny_model())
    assert engine.device == "cpu" and engine.tree_unsupported is None and default_drafter(engine) == "suffix"
    assert LlamaModel.device == "cpu"
