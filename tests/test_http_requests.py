"""Request validation of `specx serve`'s API (cli/http/requests.py), without a model or a server:
a fake tokenizer (characters as tokens) stands in for the model's, so these run in milliseconds.
`tests/test_serve.py` sends the same kinds of requests to a real server."""

import pytest

from specx.http.errors import ApiError
from specx.http.requests import parse_request
from specx.http.tokens import Tokenizers

MODEL = "smollm2-135m"

class FakeTokenizer:
    """Characters as tokens; a chat template that joins role and content."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 1000 for c in text]

    def decode(self, ids, **kwargs):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")


def parse(body, endpoint="chat.completions", context=64):
    return parse_request(body, endpoint, [MODEL], context, Tokenizers(FakeTokenizer(), 1000))


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def test_parse_chat_defaults_follow_openai():
    req, stream, include_usage = parse(chat_body())
    assert req.prompt_ids == FakeTokenizer().encode("<user>hi<assistant>")
    settings = req.settings  # what the worker hands to generate as it is
    assert settings.max_new_tokens == 64 - len(req.prompt_ids)  # chat: whatever fits
    assert (settings.temperature, settings.top_p, req.n, settings.stop, settings.seed) == (1.0, 1.0, 1, (), None)
    assert (settings.eos_token_ids, settings.grammar, settings.logprobs) == ((), None, -1)  # this tokenizer has no EOS
    assert (stream, include_usage) == (False, False)
    ends = Tokenizers(FakeTokenizer(), 1000, eos_token_id=0)  # the server's: its model's EOS
    assert parse_request(chat_body(), "chat.completions", [MODEL], 64, ends)[0].settings.eos_token_ids == (0,)
    assert req.id.startswith("chatcmpl-") and req.prompt_messages == [{"role": "user", "content": "hi"}]


def test_parse_completions_and_options():
    req, stream, include_usage = parse({"model": MODEL, "prompt": ["abc"], "stream": True, "max_completion_tokens": 5,
                                        "stream_options": {"include_usage": True}, "stop": "\n", "seed": 3,
                                        "temperature": 0, "n": 2}, "completions")
    settings = req.settings
    assert (req.prompt_text, req.prompt_ids) == ("abc", [97, 98, 99])
    assert (settings.max_new_tokens, settings.stop) == (5, ("\n",))
    assert (stream, include_usage, settings.seed, settings.temperature, req.n) == (True, True, 3, 0.0, 2)
    assert parse({"model": MODEL, "prompt": "abc"}, "completions")[0].settings.max_new_tokens == 16  # OpenAI's default
    assert parse({"model": MODEL, "prompt": [5, 6]}, "completions")[0].prompt_ids == [5, 6]
    text = parse(chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                     {"role": "assistant", "content": None, "tool_calls": []}]))[0]
    assert text.prompt_ids == FakeTokenizer().encode("<user>ab<assistant><assistant>")


@pytest.mark.parametrize("body,endpoint,status,code", [
    ([1], "chat.completions", 400, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat.completions", 400, "missing_required_parameter"),
    ({"model": MODEL}, "chat.completions", 400, "missing_required_parameter"),
    ({"model": MODEL, "messages": []}, "chat.completions", 400, "invalid_type"),
    ({"model": MODEL, "messages": ["hi"]}, "chat.completions", 400, "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "boss", "content": "hi"}]}, "chat.completions", 400, "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "chat.completions", 400, "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "chat.completions", 400,
     "unsupported_content"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "chat.completions", 404, "model_not_found"),
    (chat_body(max_tokens=-1), "chat.completions", 400, "integer_below_min_value"),
    (chat_body(max_tokens=0), "chat.completions", 400, "integer_below_min_value"),
    (chat_body(max_tokens=10**9), "chat.completions", 400, "context_length_exceeded"),
    (chat_body(max_tokens="8"), "chat.completions", 400, "invalid_type"),
    (chat_body(max_tokens=True), "chat.completions", 400, "invalid_type"),
    (chat_body(messages=[{"role": "user", "content": "x" * 80}]), "chat.completions", 400, "context_length_exceeded"),
    (chat_body(temperature=2.5), "chat.completions", 400, "invalid_value"),
    (chat_body(temperature="hot"), "chat.completions", 400, "invalid_type"),
    (chat_body(top_p=0), "chat.completions", 400, "invalid_value"),
    (chat_body(top_p=1.5), "chat.completions", 400, "invalid_value"),
    (chat_body(n=0), "chat.completions", 400, "integer_below_min_value"),
    (chat_body(n=100), "chat.completions", 400, "integer_above_max_value"),
    (chat_body(stop=[""]), "chat.completions", 400, "invalid_value"),
    (chat_body(stop=[1]), "chat.completions", 400, "invalid_type"),
    (chat_body(stream="yes"), "chat.completions", 400, "invalid_type"),
    (chat_body(stream_options={"include_usage": True}), "chat.completions", 400, None),
    (chat_body(top_logprobs=3), "chat.completions", 400, "invalid_value"),
    (chat_body(logprobs=True, top_logprobs=21), "chat.completions", 400, "integer_above_max_value"),
    (chat_body(logprobs=1), "chat.completions", 400, "invalid_type"),
    ({"model": MODEL, "prompt": "a", "logprobs": True}, "completions", 400, "invalid_type"),
    (chat_body(frequency_penalty=0.5), "chat.completions", 400, "unsupported_parameter"),
    (chat_body(response_format={"type": "json_object"}), "chat.completions", 400, "unsupported_parameter"),  # no
    # grammar vocabulary (test_parse_response_format has one)
    (chat_body(response_format={"type": "xml"}), "chat.completions", 400, "invalid_value"),
    (chat_body(response_format="json"), "chat.completions", 400, "invalid_type"),
    ({"model": MODEL}, "completions", 400, "missing_required_parameter"),
    ({"model": MODEL, "prompt": ""}, "completions", 400, None),
    ({"model": MODEL, "prompt": ["a", "b"]}, "completions", 400, "unsupported_parameter"),
    ({"model": MODEL, "prompt": [1, 5000]}, "completions", 400, "invalid_value"),
    ({"model": MODEL, "prompt": {"text": "a"}}, "completions", 400, "invalid_type"),
    ({"model": MODEL, "prompt": "a", "echo": True}, "completions", 400, "unsupported_parameter"),
])
def test_parse_rejects_bad_input(body, endpoint, status, code):
    with pytest.raises(ApiError) as err:
        parse(body, endpoint)
    assert (err.value.status, err.value.code) == (status, code)
    assert err.value.message


def test_parse_accepts_neutral_values_of_unsupported_parameters():
    req = parse(chat_body(logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                          response_format={"type": "text"}, tools=[{"type": "function", "function": {"name": "f"}}],
                          tool_choice="auto", user="u1", max_tokens=None), context=10_000)[0]
    assert req.settings.max_new_tokens >= 1


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_go_into_the_system_prompt_of_a_template_that_ignores_them():
    from specx.core.serve.tools import tools_system_prompt

    req = parse(chat_body(tools=TOOLS), context=10_000)[0]
    fake = FakeTokenizer()
    prompt = fake.decode(req.prompt_ids)
    assert prompt.startswith("<system>" + tools_system_prompt("hermes", [TOOLS[0]["function"]]))
    assert (req.tool_parser, req.tool_names, req.settings.grammar) == ("hermes", ["get_weather"], None)  # auto: none
    assert req.prompt_messages == [{"role": "user", "content": "hi"}]  # the client's messages are what is stored
    none = parse(chat_body(tools=TOOLS, tool_choice="none"), context=10_000)[0]
    assert fake.decode(none.prompt_ids) == "<user>hi<assistant>" and none.tool_parser is None
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12 C"}]
    text = fake.decode(parse(chat_body(messages=history), context=10_000)[0].prompt_ids)
    assert '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<user><tool_response>\n12 C\n</tool_response><assistant>" in text


@pytest.mark.parametrize("extra,param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_name_their_param(extra, param):
    with pytest.raises(ApiError) as err:
        parse(chat_body(**extra), context=10_000)
    assert (err.value.status, err.value.param) == (400, param)


def test_parse_logprobs():
    assert parse(chat_body())[0].settings.logprobs == -1
    assert parse(chat_body(logprobs=True))[0].settings.logprobs == 0
    assert parse(chat_body(logprobs=True, top_logprobs=5))[0].settings.logprobs == 5
    assert parse({"model": MODEL, "prompt": "a", "logprobs": 2}, "completions")[0].settings.logprobs == 2
    assert parse({"model": MODEL, "prompt": "a", "logprobs": 0}, "completions")[0].settings.logprobs == 0


def test_parse_response_format(builtin_vocabulary):
    tokenizers = Tokenizers(FakeTokenizer(), 1000, builtin_vocabulary)

    def fmt(response_format):
        return parse_request(chat_body(response_format=response_format), "chat.completions", [MODEL], 64,
                             tokenizers)[0].settings.grammar

    assert fmt({"type": "text"}) is None
    assert "json_schema" in fmt({"type": "json_object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert '"integer"' in fmt({"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}})
    for bad, param, code in (({"type": "json_schema"}, "response_format.json_schema", "missing_required_parameter"),
                             ({"type": "json_schema", "json_schema": {"name": "a b", "schema": schema}},
                              "response_format.json_schema.name", "invalid_value"),
                             ({"type": "json_schema", "json_schema": {"name": "A", "schema": []}},
                              "response_format.json_schema.schema", "invalid_type"),
                             ({"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "nope"}}},
                              "response_format.json_schema.schema", "invalid_value")):
        with pytest.raises(ApiError) as err:
            fmt(bad)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, code), bad


def test_only_what_a_template_can_render_is_kept_and_bounded():
    junk = "x" * (8 * 1024 * 1024)  # a client's metadata field: neither rendered nor stored
    body = chat_body(messages=[{"role": "user", "content": "hi", "metadata": junk, "name": "ann"},
                               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]},
                               {"role": "tool", "content": "4", "tool_call_id": "c1", "extra": {"a": 1}}])
    req = parse(body, context=10_000)[0]
    assert req.prompt_messages == [{"role": "user", "content": "hi", "name": "ann"},
                                   {"role": "assistant", "content": "", "tool_calls": body["messages"][1]["tool_calls"]},
                                   {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    with pytest.raises(ApiError) as err:  # what is kept is bounded too
        parse(chat_body(messages=[{"role": "user", "content": "hi", "name": junk}]), context=10_000)
    assert (err.value.status, err.value.code, err.value.param) == (400, "message_too_large", "messages.[0]")


def test_parse_prediction():
    req = parse(chat_body(prediction={"type": "content", "content": "SELECT 1"}))[0]
    assert req.prediction_ids == FakeTokenizer().encode("SELECT 1")
    parts = parse(chat_body(prediction={"type": "content", "content": [{"type": "text", "text": "SELECT"},
                                                                       {"type": "text", "text": " 1"}]}))[0]
    assert parts.prediction_ids == req.prediction_ids
    for bad, code in (({"type": "text", "content": "x"}, "invalid_value"), ({"type": "content", "content": 5},
                                                                            "invalid_type"), ("x", "invalid_value")):
        with pytest.raises(ApiError) as err:
            parse(chat_body(prediction=bad))
        assert (err.value.status, err.value.code) == (400, code)


def test_kept_fields_and_predictions_are_bounded():
    """What a request stores or holds in memory has a bound, refused with a 400 naming the param
    (a probe sent 250 KB names in 100 messages, 1 MB stop strings and a 10 MB prediction)."""
    from specx.http.requests import MAX_MESSAGES_FIELDS_CHARS, MAX_NAME_CHARS, MAX_STOP_CHARS

    def refused(body, context=10_000):
        with pytest.raises(ApiError) as err:
            parse(body, context=context)
        return err.value.status, err.value.param

    assert refused(chat_body(messages=[{"role": "user", "content": "hi", "name": "n" * (MAX_NAME_CHARS + 1)}])) \
        == (400, "messages.[0].name")
    assert parse(chat_body(messages=[{"role": "user", "content": "hi", "name": "n" * MAX_NAME_CHARS}]), context=10_000)
    many = [{"role": "tool", "content": "4", "tool_call_id": "c" * 200_000} for _ in range(6)]
    assert 6 * 200_000 > MAX_MESSAGES_FIELDS_CHARS
    assert refused(chat_body(messages=many))[0] == 400
    assert refused(chat_body(stop=["x" * (MAX_STOP_CHARS + 1)])) == (400, "stop")
    prediction = {"type": "content", "content": "y" * 100}
    assert refused(chat_body(prediction=prediction), context=99) == (400, "prediction.content")  # more tokens than fit
    assert refused(chat_body(prediction={"type": "content", "content": "y" * 2_000_000})) == (400, "prediction.content")
    assert parse(chat_body(prediction=prediction), context=200)[0].prediction_ids == [ord("y")] * 100


def test_schemas_the_grammar_library_cannot_build_are_refused_up_front(builtin_vocabulary):
    """A schema nested 200 deep, or a regex whose automaton explodes, is a 400 naming the param,
    not a 500 (before: recursion limit exceeded; a lexer error mid-generation)."""
    tokenizers = Tokenizers(FakeTokenizer(), 1000, builtin_vocabulary)
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    regex = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
             "required": ["a"]}
    for schema in (deep, regex):
        with pytest.raises(ApiError) as err:
            parse_request(chat_body(response_format={"type": "json_schema", "json_schema": {"name": "A",
                                                                                             "schema": schema}}),
                          "chat.completions", [MODEL], 64, tokenizers)
        assert (err.value.status, err.value.param) == (400, "response_format.json_schema.schema")
        assert "<state>" not in err.value.message and len(err.value.message) < 700


@pytest.mark.parametrize("body,endpoint,param", [
    (chat_body(stop=["ok", "\ud800"]), "chat.completions", "stop.[1]"),
    (chat_body(stop="\udfff"), "chat.completions", "stop"),
    (chat_body(model="\ud800"), "chat.completions", "model"),
    (chat_body(prediction={"type": "content", "content": "SELECT \ud800"}), "chat.completions", "prediction.content"),
    (chat_body(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": "a\udc00b"}]),
     "chat.completions", "messages.[1].content"),
    (chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]), "chat.completions",
     "messages.[0].content.[0].text"),
    (chat_body(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), "chat.completions",
     "messages.[0].name"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}]), "chat.completions",
     "tools.[0].function.description"),
    ({**chat_body(), "\ud800x": 1}, "chat.completions", "\\ud800x"),
    ({"model": MODEL, "prompt": "\ud800"}, "completions", "prompt"),
    ({"model": MODEL, "prompt": ["x\ud800"]}, "completions", "prompt.[0]"),
])
def test_lone_surrogates_anywhere_are_refused_naming_the_param(body, endpoint, param):
    """Issue 39, cases 1 and 6: a lone surrogate is not text (UTF-8 cannot encode it): in `stop` it
    ended the worker thread (the store could not take it), in `model`, `prediction` or a prompt it
    was a 500. Anywhere in a request it is now a 400 naming where it is, whose body renders."""
    with pytest.raises(ApiError) as err:
        parse(body, endpoint)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, "invalid_value")
    assert "lone surrogate" in err.value.message
    assert err.value.response().status_code == 400  # the error body itself is valid UTF-8


def test_tokenize_refuses_lone_surrogates_and_text_that_cannot_fit():
    from specx.http.requests import parse_detokenize, parse_tokenize

    tokenizers = Tokenizers(FakeTokenizer(), 1000)
    for body, param in (({"prompt": "\ud800"}, "prompt"), ({"model": "\ud800", "prompt": "x"}, "model"),
                        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages.[0].content")):
        with pytest.raises(ApiError) as err:
            parse_tokenize(body, [MODEL], tokenizers)
        assert (err.value.status, err.value.param) == (400, param)
    with pytest.raises(ApiError) as err:
        parse_detokenize({"model": "\ud800", "tokens": [1]}, [MODEL], 1000)
    assert (err.value.status, err.value.param) == (400, "model")
    assert parse_tokenize({"prompt": "x" * 1024}, [MODEL], tokenizers, 64) == [ord("x")] * 1024
    for body, param in (({"prompt": "x" * 1025}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x" * 1025}]}, "messages")):
        with pytest.raises(ApiError) as err:
            parse_tokenize(body, [MODEL], tokenizers, 64)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, "context_length_exceeded")


def test_prompts_messages_and_tools_are_bounded_in_characters_before_tokenizing():
    """Issue 39, case 5: prompts were tokenized whole before the length check (three 30 MB prompts
    took the server to 8.7 GB). Text longer than 16 characters per context token can never fit:
    refused before the tokenizer sees it, with a 400 naming the field and the limit."""
    class Counting(FakeTokenizer):
        chars = 0

        def encode(self, text, add_special_tokens=False):
            Counting.chars += len(text)
            return super().encode(text)

    tokenizers = Tokenizers(Counting(), 1000)
    limit = 16 * 64  # limits.PROMPT_CHARS_PER_TOKEN per token of a 64-token context
    tool = {"type": "function", "function": {"name": "f", "description": "d" * (limit // 2)}}
    cases = [({"model": MODEL, "prompt": "x" * (limit + 1)}, "completions", "prompt"),
             ({"model": MODEL, "prompt": ["x" * 30_000_000]}, "completions", "prompt"),
             (chat_body(messages=[{"role": "user", "content": "x" * (limit // 2)}] * 3), "chat.completions",
              "messages"),
             (chat_body(messages=[{"role": "user", "content": "x" * (limit // 2)}], tools=[tool]), "chat.completions",
              "tools")]
    for body, endpoint, param in cases:
        Counting.chars = 0
        with pytest.raises(ApiError) as err:
            parse_request(body, endpoint, [MODEL], 64, tokenizers)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, "context_length_exceeded")
        assert f"{limit:,}" in err.value.message and "64 tokens" in err.value.message
        assert Counting.chars == 0  # nothing was tokenized


def test_an_api_key_no_client_can_send_is_refused():
    """Issue 39, case 9: a non-ASCII --api-key was accepted at start and no client could ever send
    it (an HTTP header carries visible ASCII only): every request got 401."""
    import typer

    from specx.http.app import Api

    bad, good = ("clé", "ключ", "two words", "tab\tkey", "nul\x00"), (None, "", "sk-Abc_123.~!")
    for key in bad:
        with pytest.raises(ValueError, match="visible ASCII"):
            Api(None, [MODEL], key)
    for key in good:
        Api(None, [MODEL], key)
    from specx.commands.options import check_api_key  # what `specx serve` calls: one line naming --api-key

    for key in bad:
        with pytest.raises(typer.BadParameter) as err:
            check_api_key(key)
        assert err.value.param_hint == "--api-key" and "\n" not in err.value.format_message()
    for key in good:
        assert check_api_key(key) == key


def test_detokenize_is_bounded_by_the_context_before_anything_is_checked_or_decoded():
    """Issue 47, case 2: 15,000,000 ids in a 30 MB body were decoded (a 180 MB answer, the server
    from 0.76 to 4.5 GB, /health held for 11.8 s). More ids than the context is a 400 naming `tokens`."""
    from specx.http.requests import parse_detokenize

    assert parse_detokenize({"tokens": [1] * 64}, [MODEL], 1000, 64) == [1] * 64
    for tokens in ([1] * 65, ["not an id"] * 15_000_000):  # refused by their count, before each is looked at
        with pytest.raises(ApiError) as err:
            parse_detokenize({"tokens": tokens}, [MODEL], 1000, 64)
        assert (err.value.status, err.value.param, err.value.code) == (400, "tokens", "context_length_exceeded")
        assert f"{len(tokens):,} token ids, more than this model's context of 64" in err.value.message
