"""The quantized engine (core/model/quantized/quant.py, qkernel.py, qforward.py, qengine.py): every tensor type
unpacks as gguf-py de-quantizes it, the kernel matches a brute-force de-quantized product on every
type and is batch-invariant, and speculation on the engine is its plain decoding token for token
(greedy, sampled, under a grammar), on tiny random GGUFs of each type and on the built-in model."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specx.core.decode.generate import generate
from specx.core.decode.grammar import json_schema_grammar
from specx.core.decode.request import Decoding
from specx.core.model.quantized import arch, kernel as qkernel, quant, target
from specx.core.model.quantized.engine import GGUFError, QuantEngine
from specx.core.model.quantized.quant import UnsupportedType
from specx.core.model.random_gguf import random_blocks, tiny_gguf

from helpers.decoding import MAKERS, SCHEMA, FakeDrafter, collect

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_unpack_gives_exactly_what_gguf_py_dequantizes(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(rng, qtype, 24, 512)
    q, scales, mins = quant.unpack(raw, int(qtype), 512)
    fmt = quant.FORMATS[qtype.name]
    assert np.array_equal(quant.dequantize(q, scales, mins, fmt), gguf.quants.dequantize(raw, qtype).reshape(24, 512))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_read_back_from_the_panels_are_the_files_rows(qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    raw = random_blocks(rng, qtype, 37, 512)
    packed = quant.pack_tensor(raw, int(qtype), 512)
    ids = np.array([0, 36, 17, 5, 16])
    got = quant.unpack_rows(packed, ids)
    want = quant.unpack(raw[ids], int(qtype), 512)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert (got[2] is None) == (want[2] is None) and (got[2] is None or np.array_equal(got[2], want[2]))


def _reference(inputs: qkernel.Inputs, raw: np.ndarray, qtype) -> np.ndarray:
    """The product in float64 of the de-quantized weights and the quantized inputs, de-quantized."""
    k = inputs.k
    xq = inputs.xw.view(np.int8).reshape(k // 4, inputs.rows, 4).transpose(1, 0, 2).reshape(inputs.rows, k)
    x = xq.astype(np.float64) * np.repeat(inputs.dx.T, 32, axis=1)
    return x @ gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], k).astype(np.float64).T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("family", arch.FAMILIES)
def test_the_kernel_matches_a_dequantized_reference_and_is_batch_invariant(qtype, family):
    """Every instruction-set family this CPU executes (each compiled here, whatever numba's target):
    close to the float64 product, a row's bits the same alone and among others, and the same bits
    as the generic kernel (the dots are exact integers in every family)."""
    if not target.runs_here(family):
        pytest.skip(f"this CPU does not execute {family}")
    rng = np.random.default_rng(7)
    raw = random_blocks(rng, qtype, 40, 512)  # 40 outputs: a padded last panel
    packed = quant.pack_tensor(raw, int(qtype), 512)
    x = rng.standard_normal((23, 512)).astype(np.float32)  # 23 rows: tiles of 8, 4, 2 and 1

    def product(rows: np.ndarray, name: str = family) -> np.ndarray:
        inputs = qkernel.Inputs(rows)
        out = np.empty((len(rows), packed.values.shape[0] * 16), dtype=np.float32)
        qkernel.driver(packed.fmt, name)(*packed.arrays, inputs.xw, inputs.dx, inputs.sx, inputs.xs, out)
        return out[:, :40]

    together = product(x)
    want = _reference(qkernel.Inputs(x), raw, qtype)
    assert np.abs(together - want).max() <= 1e-5 * np.abs(want).max()
    for i in (0, 5, 13, 22):  # each row alone, and among others in another group: the same bits
        assert np.array_equal(product(x[i : i + 1]), together[i : i + 1])
        assert np.array_equal(product(x[i : i + 3][::-1])[-1], together[i])
    assert np.array_equal(together, product(x, "generic"))


def test_quantized_inputs_are_rint_of_x_over_the_block_scale():
    """Inputs: q = rint(x / d) clamped to 127, d = max|x| / 127 per 32, the sums per 16: a numpy
    reference, rows alone and together (64 rows of 576: the threads' path, past 32K values)."""
    rng = np.random.default_rng(3)
    for rows in (1, 3, 64):
        x = (rng.standard_normal((rows, 576)) * rng.uniform(0.01, 10, (rows, 1))).astype(np.float32)
        x[0, :32] = 0
        x[-1, 40] = 0.5 * x[-1, 32:64].max() / 127 * 127  # a tie or two on the way
        inputs = qkernel.Inputs(x)
        blocks = x.reshape(rows, -1, 32)
        d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8).reshape(rows, -1)
        got = inputs.xw.view(np.int8).reshape(144, rows, 4).transpose(1, 0, 2).reshape(rows, 576)
        assert np.array_equal(got, q) and np.array_equal(inputs.dx, d.T)
        assert np.array_equal(inputs.sx, q.reshape(rows, -1, 16).astype(np.int32).sum(2).T)
        for i in range(rows):
            assert np.array_equal(qkernel.Inputs(x[i : i + 1]).xw[:, 0], inputs.xw[:, i])


# what a CPU name compiles to, and the instructions its kernel must (and must not) hold
NAMED_TARGETS = {"haswell": ("avx2", "vpmaddubsw", "vpdpbusd"), "alderlake": ("avxvnni", "vpdpbusd", "vpmaddubsw"),
                 "znver4": ("avx512vnni", "vpdpbusd", "vpmaddubsw")}


@pytest.mark.parametrize("cpu_name", sorted(NAMED_TARGETS))
def test_each_family_compiles_for_its_cpu_and_runs_where_it_can(cpu_name, tmp_path):
    """NUMBA_CPU_NAME picks the family (any machine compiles any of them); its machine code holds
    the family's dot instruction (AVX2: no zmm register, no VNNI); where this CPU executes it,
    the kernel runs and agrees with a de-quantized reference."""
    family, must, must_not = NAMED_TARGETS[cpu_name]
    code = f"""
import numpy as np, numba, gguf
from specx.core.model.quantized import kernel as qkernel, quant, target
assert target.isa() == {family!r}, target.isa()
rng = np.random.default_rng(1); w = rng.standard_normal((32, 256)).astype(np.float32)
raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0); p = quant.pack_tensor(raw, 2, 256)
x = rng.standard_normal((3, 256)).astype(np.float32); inputs = qkernel.Inputs(x)
out = np.empty((3, 32), dtype=np.float32); run = qkernel.driver(p.fmt)
args = (*p.arrays, inputs.xw, inputs.dx, inputs.sx, inputs.xs, out)
sig = tuple(numba.typeof(a) for a in args); run.compile(sig)
lib = run.overloads[sig].library
asm = lib._codegen._tm.emit_assembly(lib._final_module)
assert {must!r} in asm and {must_not!r} not in asm
assert {family!r} == "avx512vnni" or "%zmm" not in asm
if target.runs_here({family!r}):
    run(*args); ref = x @ gguf.quants.dequantize(raw, 2).reshape(32, 256).T
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max(), np.abs(out - ref).max()
print("ok")
"""
    # a cache of its own: the machine code is read from the compilation, not from numba's cache
    env = {**os.environ, "NUMBA_CPU_NAME": cpu_name, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return {t: QuantEngine(tiny_gguf(folder / f"{t.name}.gguf", t, seed=int(t))) for t in (T.Q4_K, T.Q6_K, T.Q8_0)}


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_speculative_greedy_is_the_engines_plain_greedy(tiny_engines, qtype):
    engine = tiny_engines[qtype]
    prompt = [11, 22, 33, 44, 55]
    want = engine.plain(prompt, 40, None)
    for make in MAKERS:
        for seed in range(2):
            out, steps = collect(generate(engine, prompt, FakeDrafter(make, want, seed), Decoding(max_new_tokens=40)))
            assert out == want, (make.__name__, seed)
    plain, steps = collect(generate(engine, prompt, None, Decoding(max_new_tokens=40)))
    assert plain == want and len(steps) == len(want)


def test_a_token_gets_the_same_logits_alone_and_in_a_tree_pass(tiny_engines):
    from specx.core.draft import Draft

    engine = tiny_engines[T.Q4_K]
    session = engine.start([5, 6, 7])
    tree = Draft([8, 9, 10, 11], [-1, 0, -1, 1], [0.5] * 4, 2.0, 1)
    rows = session.score([12], tree)  # [1 + 4, V]
    session.keep_path([0, 1])  # the path 8 -> 9
    alone = engine.start([5, 6, 7])
    first = alone.score([12], Draft())
    alone.keep_path([])
    second = alone.score([8], Draft())
    alone.keep_path([])
    third = alone.score([9], Draft())
    assert torch.equal(rows[0], first[0]) and torch.equal(rows[1], second[0]) and torch.equal(rows[2], third[0])
    after = session.score([13], Draft())  # the cache holds 5 6 7 12 8 9 as plain decoding would
    alone.keep_path([])
    assert torch.equal(after[0], alone.score([13], Draft())[0])


def test_sessions_batched_in_one_pass_get_the_bits_of_their_own_passes(tiny_engines):
    """Issue 46's foundation: several requests' pending tokens and draft trees in one pass (every
    weight read once), each attending to its own cache, each row's logits exactly its own pass's."""
    from specx.core.draft import Draft
    from specx.core.model.sessions import score_batch

    engine = tiny_engines[T.Q8_0]
    prompts = [[5, 6, 7], list(range(100, 140)), [9] * 70]  # 70: prefilled in two chunks
    drafts = [Draft([8, 9, 10], [-1, 0, 0], [0.5] * 3, 1.5, 1), Draft(), Draft([1, 2], [-1, 0], [0.5] * 2, 1.0, 1)]
    alone = []
    for prompt, draft in zip(prompts, drafts):
        session = engine.start(prompt)
        alone.append(session.score([11, 12], draft))
    sessions = [engine.start(p) for p in prompts]
    together = score_batch(sessions, [[11, 12]] * 3, drafts)
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    for session, path in zip(sessions, ([0, 2], [], [0])):  # then each goes on alone, as if never batched
        session.keep_path(path)
    after = score_batch(sessions[::-1], [[13], [14], [15]][::-1], [Draft()] * 3)[::-1]
    for prompt, draft, path, tok, got in zip(prompts, drafts, ([0, 2], [], [0]), (13, 14, 15), after):
        session = engine.start(prompt)
        session.score([11, 12], draft)
        session.keep_path(path)
        assert torch.equal(session.score([tok], Draft()), got)


def test_the_engine_chooses_every_passes_threads_and_the_bits_stay(tmp_path):
    """Thread tuning lives in the engine (issue 60): once asked (tune_threads), every pass it runs,
    a prompt's prefill chunks, a session's step, several sessions' batch, chooses its thread count
    from one tuner, timed by the pass's size; on either count the logits are the same bits."""
    import numba

    from specx.core.draft import Draft
    from specx.core.model.sessions import PREFILL_CHUNK, score_batch
    from specx.core.model.threads import set_threads

    threads = numba.get_num_threads()
    if threads < 2:
        pytest.skip("one thread: nothing to choose")
    engine = QuantEngine(tiny_gguf(tmp_path / "q8.gguf", T.Q8_0, seed=3))
    prompt = list(range(1, 2 * PREFILL_CHUNK + 6))  # all but its last token prefilled: 64 + 64 + 4
    want = engine.plain(prompt, 20, None)
    assert engine.tuner is None  # nothing tuned until asked
    sizes = []
    tuner = engine.tune_threads(lambda rows, context: sizes.append((rows, context)) or float(rows))
    assert tuner is not None and tuner.candidates == [threads, 1] and engine.tune_threads() is tuner
    applied = []
    tuner.apply = lambda n: (applied.append(n), set_threads(n))
    tuner._wait = 0  # probe at every pass: both counts run
    try:
        assert engine.plain(prompt, 20, None) == want
        assert len(applied) == 3 + 20 and set(applied) == {threads, 1}  # every pass, prefill too
        assert sizes[:3] == [(64, 0), (64, 64), (4, 128)] and sizes[3] == (1, len(prompt) - 1)
        sessions = [engine.start(prompt[:9]), engine.start(prompt[:5])]
        before = len(applied)
        score_batch(sessions, [[7], [8]], [Draft([1, 2], [-1, 0], [0.5] * 2, 1.0, 1), Draft()])
        assert len(applied) == before + 1 and sizes[-1] == (4, (9 * 3 + 5 * 1) // 4)  # one pass, its rows' mean context
    finally:
        set_threads(threads)


def test_a_kept_prompt_is_the_sessions_own_cache_and_stays_the_prompt(tiny_engines):
    """A conversation's KV is held once (the prefix cache keeps the session's cache, no copy, made at
    the prompt's size + ANSWER_ROOM): the session's tree passes and kept paths past its prompt leave
    the kept prompt as prefilled, so the next turn, copied from it, gets the bits of a fresh prefill."""
    from specx.core.draft import Draft
    from specx.core.model.sessions import ANSWER_ROOM

    engine = tiny_engines[T.Q4_K]
    prompt = list(range(200, 300))
    memory = engine.new_prefix_cache(4096)
    session = engine.start(prompt, memory)
    assert memory.num_tokens == len(prompt) and session.kv.capacity < len(prompt) + ANSWER_ROOM + 16
    for _ in range(ANSWER_ROOM // 2 + 8):  # two entries a step, past the room: the cache grows while kept
        session.score([7], Draft([8, 9, 10], [-1, -1, 1], [0.5] * 3, 1.5, 1))
        session.keep_path([1])  # a row moves: 9 takes 8's slot (written past the prompt only)
    assert session.kv.length > len(prompt) + ANSWER_ROOM
    turn = prompt + [42, 43]
    again = engine.start(turn, memory)
    fresh = engine.start(turn)
    assert again.reused == len(prompt) and fresh.reused == 0
    assert torch.equal(again.score([44], Draft()), fresh.score([44], Draft()))


def test_seeded_sampling_is_the_same_with_and_without_drafts(tiny_engines):
    engine = tiny_engines[T.Q8_0]
    prompt = [11, 22, 33, 44]
    settings = Decoding(max_new_tokens=40, temperature=4.0, top_k=50, top_p=0.99, seed=42)  # a random model is peaked
    plain, _ = collect(generate(engine, prompt, None, settings))
    for make in MAKERS:
        spec, steps = collect(generate(engine, prompt, FakeDrafter(make, plain + [0] * 40), settings))
        assert spec == plain, make.__name__
    other, _ = collect(generate(engine, prompt, None, replace(settings, seed=43)))
    assert other != plain


def test_constrained_decoding_is_the_same_with_and_without_drafts(tiny_engines, builtin_tokenizer, builtin_vocabulary):
    engine = tiny_engines[T.Q6_K]
    grammar = json_schema_grammar(SCHEMA)
    eos = builtin_tokenizer.eos_token_id
    prompt = builtin_tokenizer.encode("Answer in JSON:")
    want, _ = collect(generate(engine, prompt, None, Decoding(max_new_tokens=40, eos_token_ids=eos),
                               constraint=builtin_vocabulary.constraint(grammar)))
    assert builtin_tokenizer.decode(want).startswith('{"sql": "')
    for make in MAKERS:
        out, _ = collect(generate(engine, prompt, FakeDrafter(make, want),
                                  Decoding(max_new_tokens=40, eos_token_ids=eos),
                                  constraint=builtin_vocabulary.constraint(grammar)))
        assert out == want, make.__name__


def test_qwen2_biases_and_a_prefix_cache(tmp_path):
    engine = QuantEngine(tiny_gguf(tmp_path / "qwen.gguf", T.Q4_0, arch="qwen2"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = engine.plain(prompt, 12, None)
    prefixes = engine.new_prefix_cache(1024)
    assert engine.plain(prompt, 12, None, prefix_cache=prefixes) == want  # stored
    assert engine.plain(prompt, 12, None, prefix_cache=prefixes) == want  # reused
    assert prefixes.hit_tokens == len(prompt) - 1


def test_a_sequence_fills_the_models_whole_context_unless_capped(tmp_path, monkeypatch):
    """The engine takes the context the GGUF states (32K at Llama-3.2-1B's shape), not a fixed 8,192;
    load_backend's `context` (serve's --max-model-len) caps it, never raises it."""
    from specx.core.model import load

    monkeypatch.setattr(load, "load_tokenizer", lambda model, cache_dir: None)  # a tiny GGUF states none
    path = tiny_gguf(tmp_path / "long.gguf", T.Q4_0, context=20000)
    assert QuantEngine(path).context_length == 20000
    assert QuantEngine(path, 9000).context_length == 9000 and QuantEngine(path, 50000).context_length == 20000
    engine, _ = load.load_backend(str(path), tmp_path / "models", "quantized", context=12000)
    assert engine.context_length == 12000
    prompt = list(range(100, 100 + 8500))  # past 8,192: refused before, where the engine capped every model there
    assert len(engine.plain(prompt, 2, None)) == 2


def test_unsupported_types_and_damaged_files_are_one_line(tmp_path):
    from specx.core.model.load import ModelError, load_backend

    path = tmp_path / "q5k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                       ("attention.head_count", 4)):
        writer.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((64, 256)).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.integers(0, 255, (256, 176), dtype=np.uint8),
                      raw_dtype=T.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedType, match=r"tensor blk\.0\.attn_q\.weight is Q5_K"):
        QuantEngine(path)
    good = tiny_gguf(tmp_path / "good.gguf", T.Q4_0)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(GGUFError) as exc:
        QuantEngine(cut)
    assert "\n" not in str(exc.value) and "cut.gguf" in str(exc.value)
    with pytest.raises(ModelError, match="cut.gguf"):
        load_backend(str(cut), backend="quantized")


def test_the_builtin_model_speculates_losslessly_on_its_quantized_weights(builtin_tokenizer):
    from specx.core.decode.speculate import SuffixDrafter
    from specx.core.draft import Draft
    from specx.core.model.load import builtin_gguf

    engine = QuantEngine(builtin_gguf("smollm2-135m"))
    assert engine.precision.startswith("Q4_1")
    assert engine.model.weight_bytes < 130e6  # no float copy: ~4.5-6 bits a weight, not 32
    text = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
            "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n")
    prompt = builtin_tokenizer.encode(text)
    eos = builtin_tokenizer.eos_token_id
    for text, next_word in (("The capital of France is", " Paris"), ("def add(a, b):\n    return a", " +")):
        ids = builtin_tokenizer.encode(text)  # the real model's weights, read right
        top = engine.start(ids[:-1]).score([ids[-1]], Draft())[0].argmax()
        assert builtin_tokenizer.decode([int(top)]) == next_word
    want = engine.plain(prompt, 24, eos)
    out, steps = collect(generate(engine, prompt, SuffixDrafter(), Decoding(max_new_tokens=24, eos_token_ids=eos)))
    assert out == want
    assert len(steps) < len(out)


def test_a_second_process_loads_the_compiled_layers_from_numbas_cache(tmp_path):
    """The whole pass (layers, kernels, attention: closures over generated IR) is found in numba's
    cache by the next process: nothing of it compiles again (numba's own hit and miss counters)."""
    model = tiny_gguf(tmp_path / "tiny.gguf", T.Q4_K)
    code = f"""
from specx.core.model.quantized import forward as qforward
from specx.core.model.quantized.engine import QuantEngine
QuantEngine({str(model)!r})
layers = list(qforward._LAYERS.values())[0]
print(len(layers.stats.cache_hits), len(layers.stats.cache_misses))
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    assert runs[0].stdout.split() == ["0", "1"]  # compiled, and kept
    assert runs[1].stdout.split() == ["1", "0"]  # found: nothing compiled


def test_every_kernel_source_keys_numbas_cache_folder():
    """An edit to any file the kernels are built from (the arch/ files build IR with llvmlite and
    import no numba) compiles afresh: each is among the sources that name the cache folder."""
    from specx.core import numba_cache

    keyed = {p.relative_to(numba_cache._HERE).as_posix() for p in numba_cache.sources()}
    room = Path(numba_cache.__file__).parent / "model" / "quantized"
    assert {p.relative_to(numba_cache._HERE).as_posix() for p in room.rglob("*.py") if p.name != "__init__.py"} <= keyed



KERNEL = """
import sys, time
from specx.core import numba_cache
numba_cache.configure()
import numba, numpy as np

@numba.njit(cache=True)
def twice(x):
    return x * 2 + 1

VALUES = [np.int64(3), np.float64(3), np.complex128(3), np.int32(3), np.float32(3), np.int16(3), np.uint8(3), np.uint64(3)]
if sys.argv[1] == "check":  # every signature loaded from the cache, and right
    assert all(complex(twice(v)) == complex(v * 2 + 1) for v in VALUES)
    print(sum(twice.stats.cache_hits.values()), sum(twice.stats.cache_misses.values()))
else:
    while time.time() < float(sys.argv[2]):  # all at one instant
        time.sleep(0.001)
    twice(VALUES[int(sys.argv[1])])
"""


def test_processes_filling_one_kernel_cache_at_once_lose_nothing(tmp_path):
    """numba saves a compiled function in two steps (the index, then the data file it names), so
    processes compiling one function at once took one data file name: entries were lost (5 to 7
    of these 8 kept, 12 times in 14) and a file could hold another key's code (numba/numba#10128).
    Under specx's lock (core/numba_cache.py) eight processes compiling eight signatures of one
    function at one instant leave all eight, each loaded back right."""
    import time

    (tmp_path / "kern.py").write_text(KERNEL)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}
    start = time.time() + 8  # past every child's imports: they compile together
    children = [subprocess.Popen([sys.executable, str(tmp_path / "kern.py"), str(i), str(start)], env=env,
                                 stderr=subprocess.PIPE, text=True) for i in range(8)]
    for child in children:
        assert child.wait(timeout=120) == 0, child.stderr.read()[-2000:]
    done = subprocess.run([sys.executable, str(tmp_path / "kern.py"), "check"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["8", "0"], (done.stdout, done.stderr[-2000:])

def _weather(city: str) -> dict:
    return {"type": "function", "function": {"name": f"get_weather_{city.lower()}", "description": f"The weather in {city}.",
                                             "parameters": {"type": "object", "properties": {
                                                 "unit": {"enum": ["C", "F"]}, "day": {"type": "string"}},
                                                 "required": ["unit", "day"], "additionalProperties": False}}}


def test_a_tool_call_repeated_after_chat_answers_is_the_same_drafted_or_not(builtin_tokenizer, builtin_vocabulary):
    """Issue 59, hole 5: the sequence it was seen in. A few chat answers teach the global index; then
    the same tool_choice "required" call (three cities' weather tools, hermes) is asked again and
    again, so later calls draft from the earlier ones' outputs. Drafted, every answer is the
    undrafted one token for token (and no grammar error): suffix drafts of every size, trees and
    linear, sized by a cost curve or whole, adversarial trees crossing EOS; greedy and sampled."""
    from specx.core.cost.acceptance import AcceptanceModel
    from specx.core.cost.forward import ForwardCost
    from specx.core.decode.speculate import SuffixDrafter
    from specx.core.index.suffix_index import SuffixIndex
    from specx.core.model.chat import chat_tokens
    from specx.core.model.load import builtin_gguf
    from specx.core.serve.tools import ToolChoice, call_grammar, check_tools, messages_for_plain_template

    engine = QuantEngine(builtin_gguf("smollm2-135m"))
    tok, eos = builtin_tokenizer, builtin_tokenizer.eos_token_id
    functions = check_tools([_weather(c) for c in ("Paris", "London", "Tokyo")])
    grammar = call_grammar("hermes", functions, ToolChoice("required"))
    ask = [{"role": "user", "content": "What is the weather in Paris, London and Tokyo today?"}]
    prompt = chat_tokens(tok, messages_for_plain_template("hermes", ask, functions))
    index = SuffixIndex()
    curve = ForwardCost((1, 4, 8, 16, 32), (1.0, 1.2, 1.4, 1.9, 3.1))
    for question in ("Tell me about Paris.", "Is London rainy?"):  # answers the index learns
        collect(generate(engine, chat_tokens(tok, [{"role": "user", "content": question}]), SuffixDrafter(index),
                         Decoding(max_new_tokens=40, eos_token_ids=eos)))
    drafters = [  # (name, a new drafter over the shared index or around the reference, cost)
        *((f"suffix {size} {'tree' if tree else 'linear'}", lambda want, s=size, t=tree:
           SuffixDrafter(index, max_spec_tokens=s, tree=t), None) for size in (1, 4, 32) for tree in (True, False)),
        ("suffix 32 tree, sized", lambda want: SuffixDrafter(index), curve),
        *((make.__name__, lambda want, m=make: FakeDrafter(m, want + [eos] * 40), None)
          for make in MAKERS if make.__name__ in ("deep_chain", "wide_tree"))]
    for temperature in (0.0, 0.9):  # each drafted call learns its output: the next drafts from it
        settings = Decoding(max_new_tokens=100, eos_token_ids=eos, temperature=temperature, seed=11, grammar=grammar)
        want, _ = collect(generate(engine, prompt, None, settings, constraint=settings.constraint(builtin_vocabulary)))
        assert tok.decode(want).startswith('<tool_call>\n{"name": "get_weather_')
        for name, make, cost in drafters:
            out, steps = collect(generate(engine, prompt, make(want), settings, cost=cost,
                                          acceptance=AcceptanceModel() if cost else None,
                                          constraint=settings.constraint(builtin_vocabulary)))
            assert out == want, (name, temperature)
            if name == "suffix 32 tree":
                assert len(steps) < len(want) // 2  # it drafted from the calls before it
