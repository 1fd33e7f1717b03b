"""specx's vLLM plugin over a real SQLite store, without vLLM: warm start and persistence, what
the engine tells the drafter, registration and version checks, `specx serve --engine vllm`.
The drafter itself, driven as vLLM's proposer drives it: test_vllm_drafter.py."""

import importlib.util
import sys
import types

import numpy as np
import pytest

from vllm_proposer import Batch, step
from specx import vllm as plugin
from specx import vllm_drafter as drafters
from specx.core.model.load import tokenizer_fingerprint
from specx.store.calls import insert_tokens
from specx.store.db import Store
from specx.store.served import SERVED_FORMAT, ServedRequest, ServedWriter


# --------------------------------------------------------------------------- the plugin over a real store

class CharTokenizer:
    """A tokenizer with the methods the plugin uses; its vocabulary decides its fingerprint."""

    def __init__(self, vocab_size=300, name="chars"):
        self.vocab = {chr(i + 32): i for i in range(vocab_size)}
        self.name_or_path = name

    def get_vocab(self):
        return self.vocab

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids, **kwargs):
        return "".join(chr(i + 32) for i in ids)


@pytest.fixture
def store_env(tmp_path, monkeypatch):
    db = tmp_path / "agents.db"
    monkeypatch.setenv("SPECX_DB", str(db))
    monkeypatch.setenv("SPECX_SYNC_S", "0")
    monkeypatch.setenv("SPECX_LINGER_S", "0")
    return db


def serve(drafter, prompt, output, req_id):
    """Generate `output` for `prompt` through the drafter as vLLM would, one token a step;
    returns the accepted draft tokens (greedy: the longest draft prefix equal to the output)."""
    batch = Batch({req_id: list(prompt)}, order=[req_id])
    accepted, pos = 0, 0
    while pos < len(output):
        drafts = step(drafter, batch, {req_id: output[pos:pos + 1]}, num_speculative_tokens=16)
        pos += 1
        good = 0
        for tok, want in zip(drafts[0], output[pos:]):
            if tok != want:
                break
            good += 1
        if good:
            step(drafter, batch, {req_id: output[pos:pos + good]}, num_speculative_tokens=16)
            pos += good
            accepted += good
    batch.order = []
    step(drafter, batch, {})
    return accepted


def test_warm_start_and_persistence_round_trip(store_env):
    tok = CharTokenizer()
    output = [40 + (i % 7) for i in range(30)]
    cold = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    assert cold.global_index.num_tokens == 0
    cold_accepted = serve(cold, [1, 2, 3], output, "r1")
    cold.close()
    with Store(store_env) as store:
        tid = store.tokenizer_id(tokenizer_fingerprint(tok))
        rows = list(store.iter_tokens(tid))
        assert [t.tolist() for _, t in rows] == [output]  # no first or last token dropped or duplicated
        session = store.db.execute("SELECT format, model FROM sessions").fetchone()
        assert tuple(session) == (SERVED_FORMAT, "m")
        assert store.index_state(tid).num_calls == 1  # persisted at close: the next start loads it
    warm = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    assert warm.global_index.num_tokens == len(output)
    assert serve(warm, [5, 6, 7], output, "r1") > cold_accepted
    warm.close()
    with Store(store_env) as store:
        assert store.db.execute("SELECT count(*) FROM sessions").fetchone()[0] == 2  # one per engine start


def test_an_idle_engine_stores_its_last_request_and_persists_the_index(store_env, monkeypatch):
    import time

    monkeypatch.setenv("SPECX_IDLE_S", "0.2")
    tok = CharTokenizer()
    drafter = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    drafter.writer.persist_idle_s = 0.2
    batch = Batch({"a": [1, 2]}, order=["a"])
    step(drafter, batch, {"a": [7, 8, 9]})  # the last request: vLLM never stops it
    deadline = time.monotonic() + 20
    state = None
    while time.monotonic() < deadline and state is None:  # no close(): as when vLLM kills its workers
        time.sleep(0.2)
        with Store(store_env) as store:
            tid = store.tokenizer_id(tokenizer_fingerprint(tok))
            state = store.index_state(tid) if tid is not None else None
    assert state is not None and state.num_calls == 1 and state.num_tokens == 3
    drafter.close()


def test_the_model_runner_tells_the_drafter_which_requests_finished(store_env, monkeypatch):
    class GPUModelRunner:  # vLLM's model runner, as far as the plugin's hook needs it
        def _update_states(self, scheduler_output):
            return "updated"

    monkeypatch.setitem(drafters.FINISHES, "hooked", False)
    plugin.hear_finished_requests(types.SimpleNamespace(GPUModelRunner=GPUModelRunner))
    plugin.hear_finished_requests(types.SimpleNamespace(GPUModelRunner=GPUModelRunner))  # wraps once
    monkeypatch.delenv("SPECX_LINGER_S")
    tok = CharTokenizer()
    drafter = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    assert drafter.cache.linger_s == 600.0  # told when requests finish, a stopped one may wait long
    batch = Batch({"r": [1, 2]}, order=["r"])
    step(drafter, batch, {"r": [40, 41]})
    batch.order = []
    step(drafter, batch, {})  # left out of a step: stopped, still pending
    assert "r" in drafter.cached_requests
    assert GPUModelRunner()._update_states(types.SimpleNamespace(finished_req_ids={"r"})) == "updated"
    assert not drafter.cached_requests
    drafter.close()
    with Store(store_env) as store:
        tid = store.tokenizer_id(tokenizer_fingerprint(tok))
        assert [t.tolist() for _, t in store.iter_tokens(tid)] == [[40, 41]]


def test_the_served_output_is_cut_where_the_scheduler_cut_it():
    def state(tokens, max_tokens=10, eos=2, stop=(), prompt=(1, 1), repetition=None):
        params = types.SimpleNamespace(max_tokens=max_tokens, eos_token_id=eos, stop_token_ids=list(stop),
                                       repetition_detection=repetition)
        return types.SimpleNamespace(output_token_ids=list(tokens), sampling_params=params, prompt_token_ids=list(prompt))

    assert plugin.served_output(state([5, 6, 2, 7, 8]), None) == [5, 6, 2]  # drafts accepted past the EOS
    assert plugin.served_output(state([5, 6, 9, 7], stop=[9]), None) == [5, 6, 9]
    assert plugin.served_output(state([5, 6, 7, 8, 9], max_tokens=3), None) == [5, 6, 7]
    assert plugin.served_output(state([5, 6, 7, 8, 9]), max_model_len=5) == [5, 6, 7]  # 2 prompt + 3
    assert plugin.served_output(state([5, 6, 2], eos=None), None) == [5, 6, 2]
    assert plugin.served_output(state([5], repetition=object()), None) is None  # a rule not followed: unknown
    assert plugin.served_output(None, 100) is None


def test_only_rank_zero_records_and_record_can_be_off(store_env, monkeypatch):
    tok = CharTokenizer()
    other = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=1)
    serve(other, [1], [5, 6, 7], "r")
    other.close()
    monkeypatch.setenv("SPECX_RECORD", "0")
    quiet = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    serve(quiet, [1], [5, 6, 7], "r")
    quiet.close()
    with Store(store_env) as store:
        assert store.db.execute("SELECT count(*) FROM calls").fetchone()[0] == 0


def test_a_store_of_another_tokenizer_is_refused_at_start(store_env):
    with Store(store_env) as store:
        with store.db.atomic():
            tid = store.add_tokenizer("0123456789abcdef", "other-model", 1000)
        store.db.execute("INSERT INTO sources (key, path, format, sha256, size_bytes, ingested_at, num_calls,"
                         " num_errors) VALUES (x'00', 'p', 'f', '', 0, '', 1, 0)")
        store.db.execute("INSERT INTO sessions (key, source_id, session_key, format) VALUES (x'01', 1, 's', 'f')")
        store.db.execute("INSERT INTO calls (key, session_id, position, num_messages, prompt_bytes, output_pack,"
                         " output_offset, output_bytes) VALUES (x'02', 1, 0, 0, 0, 0, 0, 0)")
        with store.db.atomic():
            insert_tokens(store, tid, [(1, [1, 2, 3])])
    before = store_env.read_bytes()
    with pytest.raises(plugin.SpecxVllmError, match="other-model.*not of the served model's tokenizer"):
        drafters.EngineDrafter(24, tokenizer=CharTokenizer(), model="m", rank=0)
    assert store_env.read_bytes() == before


def test_other_writers_rows_reach_a_running_drafter(store_env, monkeypatch):
    tok = CharTokenizer()
    monkeypatch.setenv("SPECX_SYNC_S", "0.05")
    first = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    second = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)  # a replica on the same store
    serve(first, [1], [50, 51, 52, 53, 54, 55], "a")
    first.close()  # stored
    import time
    deadline = time.monotonic() + 10
    while not second._incoming and time.monotonic() < deadline:
        time.sleep(0.05)
    second.start_request("b", [50])
    assert second.num_imported == 1
    assert second.speculate("b", [50], max_spec_tokens=8).token_ids == [51]  # factor 1: one token per matched one
    second.close()


def test_writer_stores_exact_tokens_and_decoded_text(tmp_path):
    writer = ServedWriter(tmp_path / "s.db", "m", "fp", "m", 300, lambda ids: "".join(chr(i) for i in ids), "p/",
                          sync_s=0)
    writer.put(ServedRequest("r", np.array([72, 105], dtype=np.int32), np.array([33, 34], dtype=np.int32)))
    writer.close()
    with Store(tmp_path / "s.db") as store:
        (cid,) = store.db.execute("SELECT id FROM calls").fetchone()
        assert store.call_output(cid) == '!"'
        assert store.call_prompt(cid) == [{"role": "prompt_text", "content": "Hi"}]
        assert store.call_tokens(cid, store.tokenizer_id("fp")).tolist() == [33, 34]


# --------------------------------------------------------------------------- registration

def test_register_is_inert_without_specx_db(monkeypatch):
    monkeypatch.delenv("SPECX_DB", raising=False)
    monkeypatch.delitem(sys.modules, plugin.SHIM, raising=False)
    plugin.register()
    assert sys.modules.get(plugin.SHIM) is None or sys.modules[plugin.SHIM].SuffixDecodingCache \
        is not drafters.EngineDrafter


def test_install_gives_vllm_the_module_it_imports(monkeypatch):
    monkeypatch.delitem(sys.modules, "arctic_inference", raising=False)
    monkeypatch.delitem(sys.modules, plugin.SHIM, raising=False)
    plugin.install()
    assert importlib.util.find_spec("arctic_inference") is not None  # vLLM's has_arctic_inference()
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # what vLLM's proposer runs

    assert SuffixDecodingCache is drafters.EngineDrafter


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_unsupported_vllm_versions_are_refused(version):
    with pytest.raises(plugin.SpecxVllmError, match=f"vLLM {version} is not supported"):
        plugin.check_vllm_version(version)
    plugin.check_vllm_version("0.32.0")
    plugin.check_vllm_version("0.32.1+cpu")


@pytest.mark.parametrize("text, value", [("2G", 2 << 30), ("512M", 512 << 20), ("1000", 1000), ("1.5GiB", 3 << 29)])
def test_index_budget_sizes(text, value):
    assert drafters.parse_bytes(text) == value
    with pytest.raises(plugin.SpecxVllmError, match="SPECX_INDEX_BYTES"):
        drafters.parse_bytes("lots")


def test_the_byte_budget_bounds_the_warm_index(store_env, monkeypatch):
    tok = CharTokenizer()
    first = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    for i in range(20):
        serve(first, [1], [40 + i] * 50, f"r{i}")
    first.close()
    monkeypatch.setenv("SPECX_INDEX_BYTES", "4K")
    small = drafters.EngineDrafter(24, tokenizer=tok, model="m", rank=0)
    assert small.global_index.nbytes <= 4096 and 0 < small.global_index.num_sequences < 20
    small.close()


# --------------------------------------------------------------------------- specx serve --engine vllm

def test_serve_engine_vllm_hands_over_to_vllm_serve_with_the_store(tmp_path):
    import json
    import os
    import subprocess

    seen = tmp_path / "seen.json"
    fake = tmp_path / "vllm"  # stands in for the vllm executable of another venv: records how it was run
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\njson.dump({{'argv': sys.argv[1:], "
                    f"'db': os.environ.get('SPECX_DB'), 'key': os.environ.get('VLLM_API_KEY')}}, open({str(seen)!r}, 'w'))\n")
    fake.chmod(0o755)
    folder = tmp_path / "model"
    folder.mkdir()
    specx = os.path.join(os.path.dirname(sys.executable), "specx")
    proc = subprocess.run([specx, "serve", "--engine", "vllm", "--vllm", str(fake), "--model", str(folder),
                           "--db", str(tmp_path / "a.db"), "--port", "8123", "--api-key", "k",
                           "--vllm-arg=--gpu-memory-utilization=0.3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(seen.read_text())
    assert run["db"] == str(tmp_path / "a.db") and run["key"] == "k" and "k" not in run["argv"]
    assert run["argv"][:2] == ["serve", str(folder)] and run["argv"][-1] == "--gpu-memory-utilization=0.3"
    spec = json.loads(run["argv"][run["argv"].index("--speculative-config") + 1])
    assert spec["method"] == "suffix" and spec["num_speculative_tokens"] == 32
    python = tmp_path / "python3"  # the Python of vLLM's venv: its OpenAI server module
    python.symlink_to(fake)
    subprocess.run([specx, "serve", "--engine", "vllm", "--vllm", str(python), "--model", str(folder)], check=True,
                   capture_output=True, timeout=120)
    run = json.loads(seen.read_text())
    assert run["argv"][:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    proc = subprocess.run([specx, "serve", "--engine", "vllm", "--vllm", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no vllm executable" in proc.stderr
