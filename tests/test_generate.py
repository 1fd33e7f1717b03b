"""The decode loop: speculative greedy equals plain greedy token for token, whatever the drafts."""

import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specx.core.decode.generate import generate, greedy_decode
from specx.core.decode.request import Decoding
from specx.core.draft import Draft, limit_depth
from specx.core.model.transformers.engine import TransformersEngine

from helpers.cli import specx_in_process
from helpers.decoding import MAKERS, FakeDrafter, all_right, collect, deep_chain, empty, wide_tree
from helpers.models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model64():
    return tiny_model(torch.float64)


@pytest.mark.parametrize("make", MAKERS, ids=lambda m: m.__name__)
def test_speculative_greedy_equals_plain_greedy(model64, make):
    rng = random.Random(hash(make.__name__) % 1000)
    for trial in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        max_new = rng.randrange(1, 30)
        ref = greedy_decode(model64, prompt, max_new + 30)  # longer than needed: drafts look ahead
        drafter = FakeDrafter(make, ref, seed=trial)
        out, steps = collect(generate(TransformersEngine(model64), prompt, drafter, Decoding(max_new_tokens=max_new)))
        assert out == ref[:max_new]
        assert drafter.prompt == prompt and drafter.output == out and drafter.finished == [True]
        for step in steps[:-1]:
            assert len(step.new_tokens) == step.accepted + 1
            assert step.accepted <= step.draft_size
        if make is all_right:  # each full-depth step accepts every node it can use
            assert len(steps) < max_new or max_new == 1


@pytest.mark.parametrize("make", [all_right, deep_chain, wide_tree], ids=lambda m: m.__name__)
def test_drafts_crossing_eos_stop_at_eos(model64, make):
    rng = random.Random(7)
    for trial in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(5)]
        ref = greedy_decode(model64, prompt, 40)
        eos = ref[rng.randrange(1, 20)]
        want = greedy_decode(model64, prompt, 40, eos)
        assert want[-1] == eos and len(want) <= 20
        out, steps = collect(generate(TransformersEngine(model64), prompt, FakeDrafter(make, ref, trial),
                                      Decoding(max_new_tokens=40, eos_token_ids=[eos, VOCAB + 5])))
        assert out == want
        assert steps[-1].new_tokens[-1] == eos


@pytest.mark.parametrize("make", [all_right, deep_chain, wide_tree], ids=lambda m: m.__name__)
def test_stop_strings_end_decoding_on_the_completing_token(model64, make):
    from specx.core.decode.text import TextStream

    class Letters:  # token t reads as one letter
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(chr(97 + t % 26) for t in tokens)

    rng = random.Random(11)
    for trial in range(3):
        prompt = [rng.randrange(VOCAB) for _ in range(6)]
        ref = greedy_decode(model64, prompt, 40)
        text = Letters().decode(ref)
        at = rng.randrange(2, 30)
        stop = text[at : at + 3]
        end = text.find(stop) + len(stop)  # the stop string may occur earlier than where it was cut
        stream = TextStream(Letters(), stop=[stop])
        drafter = FakeDrafter(make, ref, trial)
        out, _ = collect(generate(TransformersEngine(model64), prompt, drafter, Decoding(max_new_tokens=40),
                                  stop=stream))
        assert out == ref[:end] and drafter.finished == [True]  # a stop string ends the request normally
        assert stream.text == text[: text.find(stop)] and stream.stopped_by == stop


def test_plain_decoding_is_one_token_per_step(model64):
    prompt = [3, 1, 4, 1, 5]
    out, steps = collect(generate(TransformersEngine(model64), prompt, None, Decoding(max_new_tokens=12)))
    assert out == greedy_decode(model64, prompt, 12)
    assert [len(s.new_tokens) for s in steps] == [1] * 12
    assert all(s.draft_size == 0 and s.accepted == 0 for s in steps)
    assert list(generate(TransformersEngine(model64), prompt, None, Decoding(max_new_tokens=0))) == []


def test_float32_greedy_matches_too():
    model = tiny_model(torch.float32, seed=3)
    rng = random.Random(3)
    for trial in range(4):
        prompt = [rng.randrange(VOCAB) for _ in range(8)]
        ref = greedy_decode(model, prompt, 50)
        out, _ = collect(generate(TransformersEngine(model), prompt, FakeDrafter(wide_tree, ref, trial),
                                  Decoding(max_new_tokens=30)))
        assert out == ref[:30]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (10, 0.9)])
def test_seeded_sampling_is_the_same_with_and_without_drafts(model64, top_k, top_p):
    # One uniform draw per emitted token in both paths: same seed, same text, token for token.
    prompt = [11, 22, 33, 44]
    settings = Decoding(max_new_tokens=40, temperature=0.8, top_k=top_k, top_p=top_p, seed=42)
    plain, _ = collect(generate(TransformersEngine(model64), prompt, None, settings))
    ref = plain + [0] * 40  # drafts taken from the sampled text: most are accepted
    spec, steps = collect(generate(TransformersEngine(model64), prompt, FakeDrafter(deep_chain, ref), settings))
    assert spec == plain
    assert len(steps) < len(plain)
    other, _ = collect(generate(TransformersEngine(model64), prompt, None, replace(settings, seed=43)))
    assert other != plain


def test_a_temperature_too_small_to_divide_by_decodes_greedily(model64):
    """Issue 39, case 7: temperature 1e-320 (a subnormal, inside the valid range) made logits /
    temperature overflow to inf, and softmax of infs sampled garbage, while 1e-300 was greedy.
    Below core.decode.verify.MIN_TEMPERATURE decoding is greedy, with drafts and without."""
    prompt = [11, 22, 33, 44]
    ref = greedy_decode(model64, prompt, 30)
    for temperature in (5e-324, 1e-320, 1e-310, 1e-300, 1e-6):
        plain, _ = collect(generate(TransformersEngine(model64), prompt, None,
                                    Decoding(max_new_tokens=30, temperature=temperature, seed=1)))
        spec, _ = collect(generate(TransformersEngine(model64), prompt, FakeDrafter(deep_chain, ref),
                                   Decoding(max_new_tokens=30, temperature=temperature, seed=1)))
        assert plain == spec == ref, temperature


def test_limit_depth_keeps_shallow_nodes():
    draft = Draft([1, 2, 3, 4], [-1, 0, -1, 1], [0.4, 0.3, 0.2, 0.1], 1.0, 2)
    cut = limit_depth(draft, 2)
    assert (cut.token_ids, cut.parents) == ([1, 2, 3], [-1, 0, -1])
    assert len(limit_depth(draft, 0)) == 0


def test_bad_arguments(model64):
    with pytest.raises(ValueError, match="empty"):
        list(generate(TransformersEngine(model64), [], None))
    with pytest.raises(ValueError, match="stop="):  # stop strings nothing would enforce
        list(generate(TransformersEngine(model64), [1], None, Decoding(stop="\n")))
    with pytest.raises(ValueError, match="constraint="):  # ... or a grammar
        list(generate(TransformersEngine(model64), [1], None, Decoding(grammar='start: "a"')))
    bad = FakeDrafter(lambda rng, out, ref: Draft([1], [0], [], 0, 0), [])
    with pytest.raises(ValueError, match="parent"):
        list(generate(TransformersEngine(model64), [1, 2], bad, Decoding(max_new_tokens=3)))
    assert bad.finished == [False]  # the request still ends, without learning a broken output


def test_decoding_settings_are_checked_where_they_are_made():
    for name, value in (("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("temperature", -0.5), ("max_new_tokens", -1),
                        ("logprobs", -2)):
        with pytest.raises(ValueError, match=f"{name} must be"):
            Decoding(**{name: value})
    settings = Decoding(eos_token_ids=2, stop="\n\n", seed=5)
    assert (settings.eos_token_ids, settings.stop) == ((2,), ("\n\n",))  # kept as tuples: the value is frozen
    assert Decoding(eos_token_ids=None, stop=None) == Decoding() and Decoding(eos_token_ids=[1, 2]).eos_token_ids == (1, 2)
    assert [settings.for_choice(i).seed for i in range(3)] == [5, 6, 7] and Decoding().for_choice(3).seed is None
    assert Decoding().constraint(None) is None  # no grammar: no constraint


def test_builtin_model_speculative_greedy_equals_plain(builtin_model):
    from specx.core.decode.speculate import SuffixDrafter

    # conftest points SPECX_HOME at a per-session folder (or SPECX_TEST_HOME, kept between runs):
    # the first load converts the GGUF (~30 s), later ones read the safetensors copy (< 1 s).
    model, tokenizer = builtin_model
    assert (Path(os.environ["SPECX_HOME"]) / "models" / "smollm2-135m" / "model.safetensors").is_file()
    text = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
            "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n")
    prompt = tokenizer.encode(text)
    eos = tokenizer.eos_token_id
    want = greedy_decode(model, prompt, 32, eos)
    out, steps = collect(generate(TransformersEngine(model), prompt, SuffixDrafter(),
                                  Decoding(max_new_tokens=32, eos_token_ids=eos)))
    assert out == want
    assert len(steps) < len(out)  # the request index drafts the repeated function bodies


@pytest.mark.slow
def test_generate_command_is_lossless(tmp_path):
    import json

    res = specx_in_process("generate", "Count from one to ten in words.", "--max-tokens", "24", "--compare", "--json",
                           "--db", str(tmp_path / "none.db"))
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(res.stdout)
    assert data["identical"] is True
    assert data["tokens"] == data["plain"]["tokens"] > 0
    assert data["steps"] <= data["tokens"]


def test_a_model_without_a_chat_template_is_refused_at_load_and_chat_template_gives_one(tmp_path, builtin_model):
    import json
    import shutil
    import subprocess
    import sys

    home = Path(os.environ["SPECX_HOME"])  # builtin_model converted the GGUF there
    bare = tmp_path / "no-template"
    shutil.copytree(home / "models" / "smollm2-135m", bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    command = ["generate", "Say hi.", "--model", str(bare), "--max-tokens", "4", "--fixed-size", "--json", "--db",
               str(tmp_path / "none.db")]

    def generate_cmd(*args):
        return specx_in_process(*command, *args)

    # the refusal as a user meets it: a real process, one line, exit status 1
    refused = subprocess.run([sys.executable, "-m", "specx", *command], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 1 and "has no chat template" in refused.stderr and "--chat-template" in refused.stderr
    assert "Traceback" not in refused.stderr
    for args in (["--chat-template", str(template)], ["--chat-template", template.read_text()], ["--raw"]):
        ok = generate_cmd(*args)
        assert ok.returncode == 0 and json.loads(ok.stdout)["tokens"] > 0, ok.stderr[-1500:]
    broken = generate_cmd("--chat-template", str(tmp_path / "missing.jinja"))
    assert broken.returncode == 1 and "not a template and not a readable file" in broken.stderr


def test_a_prediction_drafts_first_and_output_stays_plain_greedy():
    from specx.core.decode.speculate import PredictionDrafter, SuffixDrafter

    model = tiny_model()
    prompt = [3, 17, 42, 5, 9]
    want = greedy_decode(model, prompt, 40, None)
    for prediction, inner in ((want, None), (want, SuffixDrafter()), (want[:10] + [1, 2, 3] + want[14:], None),
                              (list(range(50, 90)), SuffixDrafter()), ([], None)):
        out, steps = collect(generate(TransformersEngine(model), prompt,
                                      PredictionDrafter(prediction, inner, max_spec_tokens=16),
                                      Decoding(max_new_tokens=40)))
        assert out == want, prediction
        if prediction == want:
            assert len(steps) <= 40 // 16 + 2  # the whole prediction accepted, 16 tokens a step
    edited, steps = collect(generate(TransformersEngine(model), prompt,
                                     PredictionDrafter(want[:10] + [1, 2, 3] + want[14:], None, max_spec_tokens=16),
                                     Decoding(max_new_tokens=40)))
    assert len(steps) <= 8  # finds its place again after the edit


def test_logprobs_are_the_models_whatever_the_drafts(model64):
    prompt = [3, 17, 42, 5, 9]
    want = greedy_decode(model64, prompt, 24)
    full = torch.log_softmax(model64(torch.tensor([prompt + want])).logits[0].double(), -1)  # [S, V]
    rows = full[len(prompt) - 1 : len(prompt) - 1 + len(want)]  # row i chose want[i]
    for make in (all_right, wide_tree, empty):
        steps = list(generate(TransformersEngine(model64), prompt, FakeDrafter(make, want),
                              Decoding(max_new_tokens=24, logprobs=3)))
        out = [t for s in steps for t in s.new_tokens]
        logprobs = [lp for s in steps for lp in s.logprobs]
        assert out == want and len(logprobs) == len(want)
        for i, lp in enumerate(logprobs):
            assert abs(lp.logprob - float(rows[i, want[i]])) < 1e-9
            assert [t for t, _ in lp.top] == torch.topk(rows[i], 3).indices.tolist()
            assert lp.top[0][0] == want[i]  # greedy: the chosen token is the most likely
    assert all(s.logprobs is None for s in generate(TransformersEngine(model64), prompt, None,
                                                    Decoding(max_new_tokens=4)))


@pytest.mark.slow
def test_a_sliding_window_model_verifies_linear_drafts_losslessly():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specx.bench.calibrate import calibrate
    from specx.core.model.transformers.tree import tree_unsupported

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).double().eval()
    assert "sliding-window" in tree_unsupported(model) and tree_unsupported(tiny_model()) is None
    prompt = [3, 17, 42, 5, 9]
    want = greedy_decode(model, prompt, 60)  # well past the window of 8
    plain, steps = collect(generate(TransformersEngine(model), prompt, None, Decoding(max_new_tokens=60)))
    assert plain == want and len(steps) == 60
    for make in MAKERS:  # trees too: the loop passes their best paths
        for seed in range(3):
            out, steps = collect(generate(TransformersEngine(model), prompt, FakeDrafter(make, want, seed),
                                          Decoding(max_new_tokens=60)))
            assert out == want, (make.__name__, seed)
            if make is all_right:
                assert len(steps) < 60 // 4
    cost = calibrate(model, sizes=(1, 4, 8), repeats=1, context=32)  # chains cropped past the window
    assert len(cost.seconds) == 3


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_and_again_when_it_changes(tmp_path, monkeypatch):
    import shutil

    import transformers

    from specx.core.model.load import builtin_gguf, converted_cache, load_model

    gguf = tmp_path / "model.gguf"
    shutil.copy(builtin_gguf("smollm2-135m"), gguf)
    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append((str(a[0]), "gguf_file" in k)) or real(*a, **k))
    cache = tmp_path / "models"
    first, tok = load_model(str(gguf), cache, device="cpu", kernels=False)
    kept = converted_cache(str(gguf), cache)
    assert (kept / "model.safetensors").is_file() and (kept / "tokenizer.json").is_file()
    second, _ = load_model(str(gguf), cache, device="cpu", kernels=False)
    assert loads == [(str(tmp_path), True), (str(kept), False)]  # converted once, then read from the copy
    prompt = tok.encode("def add(a, b):")
    assert greedy_decode(first, prompt, 8) == greedy_decode(second, prompt, 8)
    os.utime(gguf, ns=(1, 1))  # the file changed: converted again, into a new copy
    assert converted_cache(str(gguf), cache) != kept


@pytest.fixture(scope="module")
def converted_tokenizer(tmp_path_factory):
    """A models folder holding the built-in tokenizer converted from its GGUF (once), and the tokenizer."""
    from specx.core.model.load import load_tokenizer

    cache = tmp_path_factory.mktemp("converted") / "models"
    return cache, load_tokenizer("smollm2-135m", cache)


@pytest.mark.parametrize("damage", ["dev_zero", "deep_json", "fifo"])
def test_a_damaged_converted_tokenizer_is_set_aside_and_made_anew(tmp_path, damage, converted_tokenizer):
    """Issue 39: a kept copy that cannot be used never stops a start (the tokenizer of the
    built-in model, converted from its GGUF: a symlink to /dev/zero, JSON nested too deep, a FIFO)."""
    import shutil

    from specx.core.model.load import converted_cache, load_tokenizer

    converted, reference = converted_tokenizer
    cache = tmp_path / "models"
    shutil.copytree(converted, cache)  # the kept copy a first start made
    kept = converted_cache("smollm2-135m", cache)
    target = kept / "tokenizer.json"
    target.unlink()
    if damage == "dev_zero":
        target.symlink_to("/dev/zero")
    elif damage == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("[" * 100_000)
    again = load_tokenizer("smollm2-135m", cache)
    assert again.encode("SELECT name FROM singer") == reference.encode("SELECT name FROM singer")
    assert len(list(kept.parent.glob(f"{kept.name}.unusable-*"))) == 1  # set aside, where one can look
    assert (kept / "tokenizer.json").is_file()  # and made anew
