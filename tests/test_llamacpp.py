"""specx on llama.cpp (core/model/llamacpp.py): the built-in GGUF on llama-cpp-python, lossless against
llama.cpp's own greedy decoding, and the server and the CLI on it."""

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup installs it)")

from helpers.cli import specx_in_process  # noqa: E402
from specx.core.decode.request import Decoding  # noqa: E402
from specx.core.model.llamacpp import LlamaModel, greedy  # noqa: E402
from specx.core.model.load import builtin_gguf  # noqa: E402

# A table schema, then questions and SQL that repeat its names: drafts from the prompt are accepted,
# and the prompts run past 512 KV cells (where llama.cpp's attention changes code path on F16 caches).
SCHEMA = "CREATE TABLE singer (singer_id, name, country, song_name, song_release_year, age, is_male);\n"
SHOTS = "".join(f"/* Question: {q} */\nSELECT {c} FROM singer WHERE age > {a};\n\n" for q, c, a in [
    ("Names of singers older than 30", "name", 30), ("Countries of singers older than 40", "country", 40),
    ("Songs of singers older than 20", "song_name", 20), ("Release years of singers older than 50",
                                                          "song_release_year", 50)] * 6)


@pytest.fixture(scope="module")
def llama():
    model = LlamaModel(builtin_gguf("smollm2-135m"), threads=2)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts(builtin_tokenizer):
    questions = ["Names and ages of singers from France", "The oldest singer's song", "Singers older than 35",
                 "How many singers are male", "Countries of singers older than 60", "Song names of male singers"]
    return [builtin_tokenizer.encode(f"{SCHEMA}\n{SHOTS}/* Question: {q} */\nSELECT", add_special_tokens=False)
            for q in questions]


# llama-cpp-python's own Llama as specx's llama.cpp engine sets it up: 2 threads, Q8_0 KV cache (type 8)
STOCK = dict(n_ctx=2048, n_threads=2, flash_attn=True, type_k=8, type_v=8, verbose=False)
STOCK_TOKENS = 24


def stock_greedy(llm, prompt: list[int], eos: int) -> list[int]:
    """Llama.generate's greedy tokens, at most STOCK_TOKENS, eos included."""
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(tok))
        if tok == eos or len(out) == STOCK_TOKENS:
            break
    return out


@pytest.fixture(scope="module")
def stock(prompts, builtin_tokenizer):
    """llama-cpp-python's own greedy decoding (Llama.generate) of the first three prompts."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(builtin_gguf("smollm2-135m")), **STOCK)
    return [stock_greedy(llm, prompt, builtin_tokenizer.eos_token_id) for prompt in prompts[:3]]


@pytest.fixture(scope="module")
def references(llama, prompts, builtin_tokenizer):
    """core.model.llamacpp.greedy's 40 tokens for each prompt: what specx on llama.cpp must write. The
    prompts share their schema and shots: after the first, each keeps that prefix's KV cells, as a
    server does (test_rows_are_the_same_bits... is why that changes no bit)."""
    references = []
    for prompt in prompts:
        references.append(greedy(llama, prompt, 40, [builtin_tokenizer.eos_token_id]))
    return references


def test_rows_are_the_same_bits_however_the_tokens_are_batched(llama, prompts):
    """The reason for the Q8_0 KV cache: one-token passes and a draft's pass agree exactly, past 512
    cells and on either thread count."""
    prompt = prompts[0]
    assert len(prompt) > 520
    tail = prompt[-24:]
    llama.keep(0)
    llama.forward(prompt[:-24])
    batched = llama.forward(tail, logits_from=0)
    llama.keep(len(prompt) - 24)
    single = []
    for i, tok in enumerate(tail):
        llama.set_threads(1 if i % 2 else 2)
        single.append(llama.forward([tok], logits_from=0)[0])
    llama.set_threads(2)
    assert np.array_equal(batched, np.stack(single))


def test_specx_on_llamacpp_writes_llamacpp_greedy_tokens(llama, prompts, references, builtin_tokenizer):
    from specx.core.decode.generate import generate
    from specx.core.decode.speculate import SuffixDrafter

    eos = builtin_tokenizer.eos_token_id
    drafter, accepted = SuffixDrafter(max_spec_factor=4.0), 0
    for prompt, reference in zip(prompts, references):
        out = []
        settings = Decoding(max_new_tokens=40, eos_token_ids=eos)
        for step in generate(llama, prompt, drafter, settings):  # no cost: whole drafts
            out += step.new_tokens
            accepted += step.accepted
        assert out == reference
    assert accepted > 20  # the drafts were used, not only plain steps


def test_llamacpp_greedy_is_llama_cpp_pythons_own(llama, references, stock):
    """core.model.llamacpp.greedy (the reference above) writes what llama-cpp-python's Llama.generate writes."""
    assert STOCK["type_k"] == STOCK["type_v"] == llama.lib.GGML_TYPE_Q8_0  # the cache specx's engine sets
    for reference, own in zip(references, stock):
        assert reference[:STOCK_TOKENS] == own  # greedy stops at eos or runs on: its first tokens are its own


def test_grammar_logprobs_and_sampling_on_llamacpp(llama, prompts, builtin_tokenizer, builtin_vocabulary):
    from specx.core.decode.generate import generate
    from specx.core.decode.grammar import json_schema_grammar
    from specx.core.decode.speculate import SuffixDrafter

    eos = builtin_tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = json_schema_grammar(schema)
    prompt = builtin_tokenizer.encode("A singer as JSON with name and age: ", add_special_tokens=False)

    def run(drafter, constraint=None, **settings):
        steps = list(generate(llama, prompt, drafter, Decoding(max_new_tokens=40, eos_token_ids=eos, **settings),
                              constraint=constraint))
        return [t for s in steps for t in s.new_tokens], steps

    plain, _ = run(None, constraint=builtin_vocabulary.constraint(grammar))
    fast, steps = run(SuffixDrafter(), constraint=builtin_vocabulary.constraint(grammar), logprobs=2)
    assert fast == plain
    text = builtin_tokenizer.decode(fast, skip_special_tokens=True)
    assert set(json.loads(text)) == {"name", "age"}
    logprobs = [lp for s in steps for lp in s.logprobs]
    assert len(logprobs) == len(fast) and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in logprobs)
    sampled = [run(d, temperature=0.8, seed=7)[0] for d in (None, SuffixDrafter())]
    assert sampled[0] == sampled[1]


@pytest.mark.slow
def test_cli_generate_and_serve_on_llamacpp(tmp_path):
    run = specx_in_process("generate", "List three SQL keywords.", "--backend", "llama.cpp", "--max-tokens", "24",
                           "--compare", "--repeats", "1", "--json", "--db", str(tmp_path / "none.db"))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["identical"] is True and "backend: llama.cpp" in run.stderr

    from helpers.servers import KEY, MODEL, Server

    srv = Server(tmp_path / "home", tmp_path / "served.db", "--api-key", KEY, "--backend", "llama.cpp")
    try:
        assert "backend: llama.cpp" in srv.log()
        client = srv.client()
        messages = [{"role": "user", "content": "Give a singer as a JSON object with a name."}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                response_format={"type": "json_object"}, logprobs=True,
                                                top_logprobs=1)
        content = answer.choices[0].message.content
        if answer.choices[0].finish_reason == "stop":
            json.loads(content)
        else:  # cut by max_tokens: the grammar still held it to JSON so far
            assert content.lstrip().startswith("{")
        assert answer.choices[0].logprobs.content
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                response_format={"type": "json_object"}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
            answer.choices[0].message.content
        again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1  # llama.cpp's KV kept
    finally:
        assert srv.stop() in (0, -15)


@pytest.mark.slow
def test_specx_as_llama_cpp_pythons_draft_model_learns_and_persists(tmp_path, prompts, stock, builtin_tokenizer):
    from llama_cpp import Llama

    from specx.llama_draft import SpecxDraft

    draft = SpecxDraft(tmp_path / "draft.db", max_draft=4)
    # logits_all: llama-cpp-python 0.3.36 sizes its logits buffer by it, not by draft_model (without it,
    # a draft model fails past n_batch tokens)
    drafted = Llama(model_path=str(builtin_gguf("smollm2-135m")), **STOCK, draft_model=draft, logits_all=True)
    for prompt, plain in zip(prompts[:3], stock):
        assert stock_greedy(drafted, prompt, builtin_tokenizer.eos_token_id) == plain
    draft.close()
    assert draft.requests == 3 and draft.index.num_tokens > 0
    warm = SpecxDraft(tmp_path / "draft.db")  # a restart drafts from what the first one generated
    assert warm.index.num_tokens == draft.index.num_tokens
    warm.close()
