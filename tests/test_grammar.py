"""Constrained decoding (core/decode/grammar.py): speculative output under a grammar equals constrained
plain greedy decoding token for token, whatever the drafts; refused draft nodes are pruned."""

import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specx.core.decode.generate import generate, greedy_decode
from specx.core.decode.grammar import GrammarError, Vocabulary, json_schema_grammar, lark_grammar
from specx.core.decode.request import Decoding
from specx.core.draft import GRAMMAR, Draft
from specx.core.model.transformers.engine import TransformersEngine

from helpers.cli import specx_in_process
from helpers.decoding import MAKERS, SCHEMA, FakeDrafter, collect


@pytest.fixture(scope="module")
def model(builtin_tokenizer):
    """A tiny random Llama over the built-in tokenizer's vocabulary: under a JSON grammar it writes
    arbitrary allowed tokens, so the masks decide nearly every choice."""
    config = LlamaConfig(vocab_size=len(builtin_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval().requires_grad_(False)


@pytest.mark.parametrize("make", [pytest.param(m, marks=pytest.mark.slow) if m.__name__ == "all_wrong" else m
                                  for m in MAKERS], ids=lambda m: m.__name__)  # all_wrong: ~40 s, make test-slow
def test_speculative_constrained_greedy_equals_constrained_plain(model, builtin_tokenizer, builtin_vocabulary, make):
    grammar = json_schema_grammar(SCHEMA)
    eos = builtin_tokenizer.eos_token_id
    for prompt in (builtin_tokenizer.encode("Answer in JSON:"), builtin_tokenizer.encode('{"sql": "SELECT')):
        want = greedy_decode(model, prompt, 48, eos, builtin_vocabulary.constraint(grammar))
        assert builtin_tokenizer.decode(want).startswith('{"sql": "')  # the grammar, not the random model, decided
        for seed in range(3):
            out, steps = collect(generate(TransformersEngine(model), prompt, FakeDrafter(make, want, seed),
                                          Decoding(max_new_tokens=48, eos_token_ids=eos),
                                          constraint=builtin_vocabulary.constraint(grammar)))
            assert out == want, (make.__name__, seed)
        plain, steps = collect(generate(TransformersEngine(model), prompt, None,
                                        Decoding(max_new_tokens=48, eos_token_ids=eos),
                                        constraint=builtin_vocabulary.constraint(grammar)))
        assert plain == want and len(steps) == len(want)  # no drafter: one token a pass, no forced drafts


def test_seeded_sampling_under_a_grammar_is_the_same_with_and_without_drafts(model, builtin_tokenizer,
                                                                             builtin_vocabulary):
    prompt = builtin_tokenizer.encode("JSON:")
    settings = Decoding(max_new_tokens=48, eos_token_ids=builtin_tokenizer.eos_token_id, temperature=0.8, top_p=0.95,
                        seed=7, grammar=json_schema_grammar(SCHEMA))
    plain, _ = collect(generate(TransformersEngine(model), prompt, None, settings,
                                constraint=settings.constraint(builtin_vocabulary)))
    assert builtin_tokenizer.decode(plain).startswith('{"sql": "')
    for make in MAKERS:
        spec, steps = collect(generate(TransformersEngine(model), prompt, FakeDrafter(make, plain + [0] * 48), settings,
                                       constraint=settings.constraint(builtin_vocabulary)))
        assert spec == plain, make.__name__
    other = replace(settings, seed=8)
    other, _ = collect(generate(TransformersEngine(model), prompt, None, other,
                                constraint=other.constraint(builtin_vocabulary)))
    assert other != plain


def test_prune_drops_refused_nodes_with_their_subtrees(builtin_tokenizer, builtin_vocabulary):
    c = builtin_vocabulary.constraint(json_schema_grammar(SCHEMA))
    forced = c.forced()
    assert builtin_tokenizer.decode(forced) == '{"sql":'  # llguidance forces the canonical tokens of forced bytes
    first, second = forced[:2]
    word = builtin_tokenizer.encode("hello")[0]
    # roots: the first forced token with children the second (allowed) and 'hello' (refused, with its child),
    # and 'hello' (refused)
    draft = Draft([first, second, word, second, word], [-1, 0, 0, 2, -1], [0.5] * 5, 2.5, 1)
    pruned = c.prune(draft)
    assert pruned.token_ids == [first, second] and pruned.parents == [-1, 0]
    allowed = c.allowed(pruned)
    assert allowed.shape == (3, builtin_vocabulary.size)
    assert allowed[0].sum() == 1 and allowed[0, first] and allowed[1, second] and not allowed[1, word]
    assert c.forced() == forced  # prune left the state where it was
    c.advance([first])
    assert c.forced() == forced[1:]


def test_forced_tokens_lead_the_draft_and_are_accepted(model, builtin_tokenizer, builtin_vocabulary):
    eos = builtin_tokenizer.eos_token_id
    prompt = builtin_tokenizer.encode("JSON:")
    grammar = json_schema_grammar(SCHEMA)
    want = greedy_decode(model, prompt, 40, eos, builtin_vocabulary.constraint(grammar))
    drafter = FakeDrafter(MAKERS[-1], want)  # empty drafts: only the grammar drafts
    out, steps = collect(generate(TransformersEngine(model), prompt, drafter,
                                  Decoding(max_new_tokens=40, eos_token_ids=eos),
                                  constraint=builtin_vocabulary.constraint(grammar)))
    assert out == want
    assert steps[0].accepted == 3  # the forced {"sql": came in the first pass, + the bonus token


def test_lark_grammar_with_an_embedded_schema(model, builtin_tokenizer, builtin_vocabulary):
    grammar = lark_grammar('start: "<tool_call>" call "</tool_call>"\ncall: %json ' + json.dumps(SCHEMA))
    eos = builtin_tokenizer.eos_token_id
    out = greedy_decode(model, builtin_tokenizer.encode("call:"), 60, eos, builtin_vocabulary.constraint(grammar))
    assert builtin_tokenizer.decode(out).startswith("<tool_call>{")


def test_bad_grammars_are_errors_that_say_why(builtin_vocabulary):
    with pytest.raises(GrammarError, match="no-such-type"):
        builtin_vocabulary.check(json_schema_grammar({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))
    with pytest.raises(GrammarError, match="undefined_rule"):
        builtin_vocabulary.constraint(lark_grammar("start: undefined_rule"))
    builtin_vocabulary.check(json_schema_grammar(SCHEMA))


def test_grammar_bit_has_its_own_acceptance_cell():
    from specx.core.cost.acceptance import AcceptanceModel

    acceptance = AcceptanceModel()
    forced = Draft([1, 2], [-1, 0], [0.9, 0.8], 1.7, 0, [GRAMMAR] * 2, [0, 0])
    other = Draft([1, 2], [-1, 0], [0.9, 0.8], 1.7, 0, [0, 0], [0, 0])
    for _ in range(50):
        acceptance.update(forced, [0, 1])
        acceptance.update(other, [])
    assert acceptance.estimates(forced)[1] > 0.9 > 0.1 > acceptance.estimates(other)[0]


@pytest.mark.slow
def test_builtin_model_writes_schema_valid_json_every_time(builtin_model):
    from specx.core.decode.speculate import SuffixDrafter

    model, builtin_tokenizer = builtin_model
    builtin_vocabulary = Vocabulary(builtin_tokenizer, model.config.vocab_size, builtin_tokenizer.eos_token_id)
    grammar = json_schema_grammar(SCHEMA)
    drafter = SuffixDrafter()
    system = ("Tables: singer(singer_id, name, country, age), concert(concert_id, year, stadium_id), "
              "stadium(stadium_id, name, capacity). Answer with JSON: the SQL query, the tables it reads and "
              'the number of tables, e.g. {"sql": "SELECT name FROM singer", "tables": ["singer"], "n": 1}.')
    for question in ("List singers older than 30.", "How many concerts were held in 2014?",
                     "Which stadium has the largest capacity?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = builtin_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        out, _ = collect(generate(TransformersEngine(model), prompt, drafter,
                                  Decoding(max_new_tokens=160, eos_token_ids=builtin_tokenizer.eos_token_id),
                                  constraint=builtin_vocabulary.constraint(grammar)))
        assert out[-1] == builtin_tokenizer.eos_token_id, builtin_tokenizer.decode(out)
        answer = json.loads(builtin_tokenizer.decode(out[:-1]))
        assert set(answer) == {"sql", "tables", "n"} and isinstance(answer["n"], int)


@pytest.mark.slow
def test_generate_json_schema_is_lossless_and_valid(tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    (tmp_path / "cat.json").write_text(json.dumps(schema))

    def generate(*args):
        return specx_in_process("generate", "Describe a cat as JSON with its name and age.", "--max-tokens", "60",
                                "--fixed-size", "--db", str(tmp_path / "none.db"), *args)

    run = generate("--json-schema", str(tmp_path / "cat.json"), "--compare", "--json")
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    cat = json.loads(result["text"])
    assert result["identical"] and set(cat) == {"name", "age"} and isinstance(cat["age"], int)
    bad = generate("--json-schema", '{"type": "no-such-type"}')
    assert bad.returncode == 2 and "no-such-type" in bad.stderr


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_token_a_verdict_holds_is_allowed_by_the_row_it_was_chosen_at(builtin_tokenizer, builtin_vocabulary,
                                                                            temperature):
    """Issue 59: a draft whose path crosses EOS, accepted whole: the walk chooses once more at the
    EOS node's row. That row allowed nothing, so every logit was -inf: greedy chose token 0 and the
    sampler, its distribution NaN, the vocabulary's last token, both outside every mask. The loop
    cuts the output at EOS, but a verdict token outside the grammar is the hole the issue names:
    now that row allows EOS alone, and every token of the verdict passes its row's mask."""
    from specx.core.decode.verify import Sampling, judge

    eos = builtin_tokenizer.eos_token_id
    c = builtin_vocabulary.constraint(json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                                                           "required": ["n"], "additionalProperties": False}), [eos])
    c.advance(builtin_tokenizer.encode('{"n": 1'))
    close = builtin_tokenizer.encode("}")
    draft = c.prune(Draft(close + [eos], [-1, 0], [0.9, 0.9], 1.8, 1))
    assert draft.token_ids == close + [eos]  # both allowed: "}" then, the object closed, EOS
    allowed = c.allowed(draft)
    logits = torch.randn(1 + len(draft), builtin_vocabulary.size, generator=torch.Generator().manual_seed(0))
    for row, tok in enumerate(draft.token_ids):  # the model writes the draft: the walk accepts every node
        logits[row, tok] = 50.0
    verdict = judge(logits, draft, Sampling(temperature, generator=torch.Generator().manual_seed(1)), allowed)
    assert verdict.accepted_nodes == [0, 1]
    rows = [0] + [1 + n for n in verdict.accepted_nodes]
    assert all(allowed[row, tok] for row, tok in zip(rows, verdict.tokens)), verdict.tokens
    assert verdict.tokens == close + [eos, eos]


def test_a_matcher_that_cannot_roll_back_is_a_grammar_error(builtin_tokenizer, builtin_vocabulary):
    """prune walks the tree with consume and rollback; a rollback the matcher refuses (llguidance's
    error state) would leave every later mask computed after tokens nobody chose: an error at once."""
    c = builtin_vocabulary.constraint(json_schema_grammar(SCHEMA))
    forced = c.forced()

    class Refusing:  # the matcher, but its rollbacks fail
        def __init__(self, matcher):
            self.matcher = matcher

        def __getattr__(self, name):
            return getattr(self.matcher, name)

        def rollback(self, num_tokens):
            return False

    c.matcher = Refusing(c.matcher)
    with pytest.raises(GrammarError, match="could not take back 2 draft tokens"):
        c.prune(Draft(forced[:2], [-1, 0], [0.5, 0.5], 1.0, 1))
