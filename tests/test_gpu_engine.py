"""The GPU engine (core/model/gpu/): its Triton kernels against torch, batch invariance bit for bit,
and speculation on it against its own plain decoding, its logits against the quantized engine's
on the same tiny random GGUFs (core.model.random_gguf).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here
before Triton is imported), with float32 products where CUDA takes bfloat16 tensor cores
(core/model/gpu/kernels.py says why); with CUDA they run on the GPU. Skipped where Triton is not
installed (the package `triton`; CUDA builds of torch bring it).
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, and by the engine
pytest.importorskip("triton", reason="the GPU engine's kernels need Triton (pip install triton)")

from specx.core.decode.generate import generate  # noqa: E402
from specx.core.decode.request import Decoding  # noqa: E402
from specx.core.draft import Draft  # noqa: E402
from specx.core.model.gpu import kernels  # noqa: E402
from specx.core.model.gpu.engine import GPUEngine, GPUPrefixCache  # noqa: E402
from specx.core.model.gpu.model import KVCache  # noqa: E402

from specx.core.model.quantized.engine import QuantEngine  # noqa: E402
from specx.core.model.random_gguf import tiny_gguf  # noqa: E402

from helpers.decoding import FakeDrafter, all_right, collect, deep_chain, wide_tree  # noqa: E402

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
DEVICE = "cuda" if CUDA else "cpu"
TENSOR_CORES = CUDA
SHAPE = dict(hidden=64, ffn=128, heads=4, kv_heads=2, vocab=128)  # the interpreter takes ~0.1 s a pass at this size


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def test_matmul_matches_torch_and_a_row_gets_its_bits_whatever_the_rows_beside_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 96, generator=g).to(DEVICE)  # 20 rows: two row tiles
    w = torch.randn(80, 96, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(80, generator=g).to(DEVICE)
    out = kernels.matmul(x, w, bias, tensor_cores=TENSOR_CORES)
    want = bf16(x) @ w.float().T + bias
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-4), (out - want).abs().max()
    for row in (0, 5, 17):
        alone = kernels.matmul(x[row : row + 1].clone(), w, bias, tensor_cores=TENSOR_CORES)
        assert torch.equal(alone[0], out[row]), row
    among_8 = kernels.matmul(x[10:18].clone(), w, bias, tensor_cores=TENSOR_CORES)
    assert torch.equal(among_8, out[10:18])


def test_matmul_rounds_its_inputs_to_bfloat16_as_torch_does():
    x = torch.randn(5, 64, dtype=torch.float64).float().to(DEVICE) * 1e3
    eye = torch.eye(64, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(kernels.matmul(x, eye, tensor_cores=TENSOR_CORES), bf16(x))  # ties to even included


def test_row_wise_kernels_match_torch():
    g = torch.Generator().manual_seed(1)
    x, delta, w = (torch.randn(*s, generator=g).to(DEVICE) for s in ((3, 200), (3, 200), (200,)))
    summed = x + delta
    out = kernels.rms_norm(x, w, 1e-5, delta)  # the residual added in place, then the norm
    assert torch.equal(x, summed)
    want = summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)

    gate_up = torch.randn(3, 64, generator=g).to(DEVICE)
    want = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    assert torch.allclose(kernels.silu_mul(gate_up), want, rtol=1e-5, atol=1e-6)

    heads, dim, positions = 3, 16, torch.tensor([0, 7, 2], dtype=torch.int32, device=DEVICE)
    angles = torch.arange(10.0)[:, None] * 10000.0 ** (-torch.arange(0, dim, 2) / dim)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    for neox in (False, True):
        q = torch.randn(3, heads * dim + 5, generator=g).to(DEVICE)  # a wider row: only `heads` heads turn
        got = q.clone()
        kernels.rope(got, heads, dim, positions, cos, sin, neox)
        v = q[:, : heads * dim].reshape(3, heads, dim)
        a, b = (v[..., : dim // 2], v[..., dim // 2 :]) if neox else (v[..., 0::2], v[..., 1::2])
        c, s = cos[positions.long()][:, None], sin[positions.long()][:, None]
        turned = torch.empty_like(v)
        ra, rb = a * c - b * s, a * s + b * c
        if neox:
            turned[..., : dim // 2], turned[..., dim // 2 :] = ra, rb
        else:
            turned[..., 0::2], turned[..., 1::2] = ra, rb
        assert torch.allclose(got[:, : heads * dim], turned.reshape(3, -1), atol=1e-6)
        assert torch.equal(got[:, heads * dim :], q[:, heads * dim :])


def test_attention_over_a_cache_and_a_tree_matches_torch(tiny):
    """Rows of a pass see the cache and the columns `allowed` marks; the kernel's softmax matches
    torch's over exactly those keys, and a row alone gets the bits it gets among the others."""
    model = tiny.model
    heads, kv_heads, dim = model.config.heads, model.config.kv_heads, model.config.head_dim
    g = torch.Generator().manual_seed(2)
    kv = model.new_cache()
    kv.reserve(45)
    cached, new = 40, 5  # 40 entries, then 5 rows: 2 pending, a root with a child, another root
    rows = torch.as_tensor(kv.rows(range(cached + new)), device=DEVICE)
    keys = torch.randn(cached + new, kv_heads, dim, generator=g).to(DEVICE, torch.bfloat16)
    values = torch.randn(cached + new, kv_heads, dim, generator=g).to(DEVICE, torch.bfloat16)
    model.pool.keys[0, rows], model.pool.values[0, rows] = keys, values
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]])
    q = torch.randn(new, heads * dim, generator=g).to(DEVICE)

    def run(which: list[int]) -> torch.Tensor:
        pages = torch.tensor(kv.pages, dtype=torch.int32, device=DEVICE)
        cols, meta = [], []
        for r in which:
            visible = torch.nonzero(allowed[r]).flatten().tolist()
            meta.append([0, cached, cached + len(visible), len(cols)])
            cols += visible
        meta = torch.tensor(meta, dtype=torch.int32, device=DEVICE)
        cols = torch.tensor(cols, dtype=torch.int32, device=DEVICE)
        return kernels.attention(q[which], model.pool.keys[0], model.pool.values[0], pages, meta, cols, heads,
                                 kv_heads, dim, 16)

    out = run(list(range(new)))
    for r in range(new):
        seen = torch.cat([torch.ones(cached, dtype=torch.bool), allowed[r].bool()])
        k, v = keys[seen].double().repeat_interleave(heads // kv_heads, 1), values[seen].double().repeat_interleave(
            heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,jhd->hj", q[r].double().view(heads, dim), k) / dim ** 0.5, -1)
        want = torch.einsum("hj,jhd->hd", p, v).reshape(-1)
        assert torch.allclose(out[r].double(), want, atol=1e-5), r
        assert torch.equal(run([r])[0], out[r])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return GPUEngine(tiny_gguf(tmp_path_factory.mktemp("gpu") / "llama.gguf", T.Q8_0, **SHAPE), device=DEVICE)


def test_the_engines_logits_are_the_quantized_engines_on_the_same_file(tiny, tmp_path):
    """The reference is another engine's reading of the same GGUF (core/model/quantized: its own
    loader, int8 activations), so a loading error (a transposed or swapped weight, the wrong rotary
    pairs) fails here: such errors put the logits' correlation near 0 and their distance above the
    largest logit. The two engines' roundings differ (bfloat16 activations here, int8 there): on
    these random models rows differ by up to ~11% of the largest logit, correlated above 0.993."""
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    chain = Draft(tokens[4:], list(range(-1, len(tokens) - 5)), [0.5] * 6, 3.0, 1)  # rows at positions 3 to 9
    qwen = tiny_gguf(tmp_path / "qwen.gguf", T.Q8_0, arch="qwen2", **SHAPE)  # biases, neox pairs
    for gpu, path in ((tiny, tiny.path), (GPUEngine(qwen, device=DEVICE), qwen)):
        got = gpu.start(tokens[:3]).score(tokens[3:4], chain).double().cpu()  # [7, V]
        want = QuantEngine(path).start(tokens[:3]).score(tokens[3:4], chain).double()
        for row, (g, w) in enumerate(zip(got, want)):
            assert (g - w).abs().max() < 0.2 * w.abs().max(), (path.name, row, (g - w).abs().max())
            assert torch.corrcoef(torch.stack([g, w]))[0, 1] > 0.98, (path.name, row)


def test_a_token_gets_the_same_logits_alone_and_in_a_tree_pass(tiny):
    session = tiny.start([5, 6, 7])
    rows = session.score([12], Draft([8, 9, 10, 11], [-1, 0, -1, 1], [0.5] * 4, 2.0, 1))  # [1 + 4, V]
    session.keep_path([0, 1])  # the path 8 -> 9
    alone = tiny.start([5, 6, 7])
    singles = []
    for tok in (12, 8, 9):
        singles.append(alone.score([tok], Draft())[0])
        alone.keep_path([])
    for got, want in zip(rows[:3], singles):
        assert torch.equal(got, want)
    assert torch.equal(session.score([13], Draft()), alone.score([13], Draft()))  # the cache: 5 6 7 12 8 9


def test_speculative_greedy_is_the_engines_plain_greedy(tiny):
    prompt = [11, 22, 33, 44, 55]
    want = tiny.plain(prompt, 16, None)
    for make in (all_right, deep_chain, wide_tree):
        out, _ = collect(generate(tiny, prompt, FakeDrafter(make, want, 0), Decoding(max_new_tokens=16)))
        assert out == want, make.__name__


def test_seeded_sampling_is_the_same_with_and_without_drafts(tiny):
    prompt = [11, 22, 33, 44]
    settings = Decoding(max_new_tokens=12, temperature=4.0, top_k=50, top_p=0.99, seed=42)  # a random model is peaked
    plain, _ = collect(generate(tiny, prompt, None, settings))
    spec, _ = collect(generate(tiny, prompt, FakeDrafter(wide_tree, plain + [0] * 12), settings))
    assert spec == plain


def test_sessions_batched_in_one_pass_get_the_bits_of_their_own_passes(tiny):
    prompts = [[5, 6, 7], list(range(30, 100)), [9] * 20]  # 70 tokens: prefilled in two chunks
    drafts = [Draft([8, 9, 10], [-1, 0, 0], [0.5] * 3, 1.5, 1), Draft(), Draft([1, 2], [-1, 0], [0.5] * 2, 1.0, 1)]
    singles = [tiny.start(p) for p in prompts]
    sessions = [tiny.start(p) for p in prompts]
    together = tiny.score_batch(sessions, [[11, 12]] * 3, drafts)
    for single, draft, got in zip(singles, drafts, together):
        assert torch.equal(single.score([11, 12], draft), got)
    paths = ([0, 2], [], [0])
    for single, session, path in zip(singles, sessions, paths):
        single.keep_path(path)
        session.keep_path(path)
    after = tiny.score_batch(sessions, [[13], [14], [15]], [Draft()] * 3)  # each cache holds its own path
    for single, tok, got in zip(singles, (13, 14, 15), after):
        assert torch.equal(single.score([tok], Draft()), got)


def test_a_row_alone_and_among_seven_others_from_other_requests(tiny):
    prompts = [[i + 1, 2 * i + 3, 50 - i][: 1 + i % 3] for i in range(8)]
    sessions = [tiny.start(p) for p in prompts]
    together = tiny.score_batch(sessions, [[7 + i] for i in range(8)], [Draft()] * 8)
    alone = tiny.start(prompts[3]).score([10], Draft())
    assert torch.equal(together[3], alone)
    from specx.core.serve.batch import batchable

    assert batchable(tiny)  # core/serve batches its passes as the quantized engine's


def test_bench_cost_counts_the_bfloat16_weights_a_pass_reads(tiny):
    from specx.bench.calibrate import pass_bytes

    h, ffn, vocab = SHAPE["hidden"], SHAPE["ffn"], SHAPE["vocab"]
    kv_width = SHAPE["kv_heads"] * h // SHAPE["heads"]
    per_layer = (h + 2 * kv_width) * h + h * h + 2 * ffn * h + h * ffn  # qkv, output, gate + up, down
    multiply_adds = 2 * per_layer + vocab * h  # two layers, then the (tied) output layer
    assert pass_bytes(tiny) == (2 * multiply_adds, multiply_adds)


def test_the_prefix_cache_and_the_pool_pages(tiny, tmp_path):
    qwen = GPUEngine(tiny_gguf(tmp_path / "qwen.gguf", T.Q8_0, arch="qwen2", **SHAPE), device=DEVICE)  # biases, neox
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    want = qwen.plain(prompt, 6, None)
    prefixes = qwen.new_prefix_cache(1024)
    assert isinstance(prefixes, GPUPrefixCache)
    assert qwen.plain(prompt, 6, None, prefix_cache=prefixes) == want
    assert qwen.plain(prompt, 6, None, prefix_cache=prefixes) == want and prefixes.hit_tokens == len(prompt) - 1
    pool = tiny.model.pool
    free = len(pool.free)
    kv = KVCache(pool)
    kv.reserve(100)
    assert len(pool.free) == free - 7  # 7 pages of 16
    del kv
    assert len(pool.free) == free  # given back when dropped


def test_the_backend_is_refused_in_one_line_without_cuda(monkeypatch, tmp_path):
    from specx.core.model.load import BACKENDS, ModelError, load_backend

    assert "gpu" in BACKENDS
    with pytest.raises(ModelError, match="runs GGUF files"):
        load_backend(str(tmp_path), backend="gpu")
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        path = tiny_gguf(tmp_path / "m.gguf", T.Q8_0, **SHAPE)
        with pytest.raises(ModelError, match="runs on CUDA"):
            load_backend(str(path), backend="gpu")


def test_auto_takes_the_gpu_once_a_trial_here_chose_it(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from specx import backends as engines
    from specx.core.model.gpu import engine as gpu_engine

    monkeypatch.setenv("SPECX_HOME", str(tmp_path / "home"))
    path = tiny_gguf(tmp_path / "m.gguf", T.Q8_0, **SHAPE)
    said = []
    monkeypatch.setattr(gpu_engine, "available", lambda: True)
    assert engines.resolve_backend(str(path), "auto", said.append) != "gpu"  # no trial yet: not proven here
    assert any("`specx engines` tries specx's GPU engine" in line for line in said)
    chosen = SimpleNamespace(engine="gpu", line=lambda: "engine: gpu (chosen by the trial here)")
    monkeypatch.setattr(engines, "kept_choice", lambda model, path, say: chosen)
    assert engines.resolve_backend(str(path), "auto", said.append) == "gpu"
    assert said[-1] == "engine: gpu (chosen by the trial here)"
    monkeypatch.setattr(gpu_engine, "available", lambda: False)  # the choice kept, the GPU gone
    assert engines.resolve_backend(str(path), "auto", said.append) != "gpu"
