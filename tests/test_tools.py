"""OpenAI tool calls (core/serve/tools.py): validation names the exact param, recorded outputs of real
models parse, tool-call history renders for plain templates, and the call grammars compile, admit
well-formed calls (token by token under the masks), refuse other names, and parse back."""

import copy
import json

import numpy as np
import pytest

from specx.core.serve.tool_calls import PARSERS, ToolCall, call_marker, parse_tool_calls
from specx.core.serve.tools import (ToolChoice, ToolsError, call_grammar, check_tool_choice, check_tools,
                                    messages_for_plain_template, parser_for_template, tools_system_prompt)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
NAMES = ("get_weather", "get_time")


# ---------------------------------------------------------------------------------- validation

def test_check_tools_returns_the_functions_with_default_parameters():
    bare = {"type": "function", "function": {"name": "ping"}}
    functions = check_tools([WEATHER, bare])
    assert functions[0] == {"name": "get_weather", "description": "Current weather of a city",
                            "parameters": WEATHER["function"]["parameters"]}
    assert functions[1] == {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    assert check_tools(None) == [] and check_tools([]) == []


@pytest.mark.parametrize("tools, param", [
    ({"type": "function"}, "tools"),
    ([WEATHER, "get_time"], "tools[1]"),
    ([{"type": "code_interpreter"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
    ([WEATHER, TIME, WEATHER], "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([TIME, {"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
])
def test_check_tools_names_the_bad_param(tools, param):
    with pytest.raises(ToolsError) as err:
        check_tools(tools)
    assert err.value.param == param


def test_check_tool_choice():
    functions = check_tools([WEATHER, TIME])
    assert check_tool_choice(None, functions) == ToolChoice("auto")
    assert check_tool_choice(None, []) == ToolChoice("none") == check_tool_choice("none", [])
    assert check_tool_choice("required", functions) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(named, functions) == ToolChoice("named", "get_time")
    for choice, fns, param in [("auto", [], "tool_choice"), (named, [], "tool_choice"),
                               ("always", functions, "tool_choice"), (3, functions, "tool_choice"),
                               ({"type": "tool", "function": {"name": "get_time"}}, functions, "tool_choice.type"),
                               ({"type": "function"}, functions, "tool_choice.function"),
                               ({"type": "function", "function": {"name": "nope"}}, functions,
                                "tool_choice.function.name")]:
        with pytest.raises(ToolsError) as err:
            check_tool_choice(choice, fns)
        assert err.value.param == param, choice


def test_parser_for_template():
    qwen = '{%- if tools %}...{{- "<tool_call>\\n{\\"name\\": \\"" }}...{%- endif %}'
    mistral = '{%- if message.tool_calls %}{{- "[TOOL_CALLS] [" }}{%- endif %}'
    llama = '{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
    llama_tag = '{{- "<|python_tag|>" + tool_call.name }}'
    assert parser_for_template(qwen) == "hermes"
    assert parser_for_template(mistral) == "mistral"
    assert parser_for_template(llama) == parser_for_template(llama_tag) == "llama3_json"
    assert parser_for_template("{{ message.content }}") == parser_for_template(None) == "hermes"


# ---------------------------------------------------------------------------------- parsing

def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parses_what_qwen_and_hermes_write():
    text = ("I'll check the weather in Paris for you.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    content, calls = parse_tool_calls("hermes", text, NAMES)
    assert content == "I'll check the weather in Paris for you."
    assert _calls(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0].arguments == '{"city": "Paris", "unit": "celsius"}'
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    # two calls, NousResearch Hermes key order, non-ASCII kept as is
    two = ('<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls("hermes", two, NAMES)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Zürich"}), ("get_time", {"tz": "CET"})]
    assert calls[0].arguments == '{"city": "Zürich"}' and calls[0].id != calls[1].id
    # arguments as a JSON string
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
    assert _calls(parse_tool_calls("hermes", text)[1]) == [("get_time", {"tz": "UTC"})]
    # the model stopped before </tool_call>
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
    content, calls = parse_tool_calls("hermes", text, NAMES)
    assert content == "Let me look." and _calls(calls) == [("get_time", {"tz": "UTC"})]


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),  # a } short
    ("hermes", '<tool_call>\n{"name": "get_stock", "arguments": {"symbol": "TSLA"}}\n</tool_call>'),  # unknown
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>'),  # no arguments
    ("hermes", "The <tool_call> tag starts a call."),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "UTC"}} and then'),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}; {"name"'),
    ("llama3_json", '{"name": "get_stock", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}'),
    ("mistral", '[TOOL_CALLS]get_stock[ARGS]{"symbol": "TSLA"}'),
    ("mistral", "[TOOL_CALLS] Sorry, I cannot."),
])
def test_what_is_not_a_well_formed_call_stays_content(parser, text):
    assert parse_tool_calls(parser, text, NAMES) == (text, [])


def test_plain_answers_stay_unchanged():
    for parser in PARSERS:
        assert parse_tool_calls(parser, " The weather is {mild}.\n", NAMES) == (" The weather is {mild}.\n", [])
        assert parse_tool_calls(parser, "") == (None, [])


def test_llama3_json_parses_what_llama_3_1_writes():
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert parse_tool_calls("llama3_json", text, NAMES)[0] is None
    assert _calls(parse_tool_calls("llama3_json", text, NAMES)[1]) == [("get_weather", {"city": "Paris",
                                                                                          "unit": "celsius"})]
    tagged = '<|python_tag|>{"name": "get_time", "arguments": {"tz": "CET"}}'
    assert _calls(parse_tool_calls("llama3_json", tagged)[1]) == [("get_time", {"tz": "CET"})]
    two = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}\n'
    content, calls = parse_tool_calls("llama3_json", two, NAMES)
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]


def test_mistral_parses_both_formats():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
            '"id": "a1B2c3D4e"}, {"name": "get_time", "arguments": {"tz": "CET"}}]')
    content, calls = parse_tool_calls("mistral", text, NAMES)
    assert content is None
    assert _calls(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "CET"})]
    assert calls[0].id == "a1B2c3D4e" and calls[1].id.startswith("call_")
    newer = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    content, calls = parse_tool_calls("mistral", newer, NAMES)
    assert content == "Checking." and _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]


def test_call_markers():
    assert [call_marker(p) for p in PARSERS] == ["<tool_call>", "{", "[TOOL_CALLS]"]
    with pytest.raises(ValueError):
        call_marker("pythonic")


# ---------------------------------------------------------------------------------- prompts

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
    {"role": "assistant", "content": "18 C and sunny; it is 14:05."},
]


def test_messages_for_plain_template_hermes():
    before = copy.deepcopy(CONVERSATION)
    functions = check_tools([WEATHER, TIME])
    out = messages_for_plain_template("hermes", CONVERSATION, functions)
    assert CONVERSATION == before
    assert all(set(m) == {"role", "content"} for m in out)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"] == tools_system_prompt("hermes", functions) + "\n\nYou are terse."
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n18 C, sunny\n</tool_response>\n"
                                 "<tool_response>\n14:05\n</tool_response>")
    assert out[4] == CONVERSATION[5] and out[1] == CONVERSATION[1]
    # what the history shows is what the parser reads
    assert _calls(parse_tool_calls("hermes", out[2]["content"], NAMES)[1]) == [("get_weather", {"city": "Paris"}),
                                                                               ("get_time", {"tz": "CET"})]


def test_messages_for_plain_template_llama_and_mistral():
    functions = check_tools([WEATHER])
    out = messages_for_plain_template("llama3_json", CONVERSATION[1:], functions)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    assert out[0]["content"] == tools_system_prompt("llama3_json", functions)
    assert out[2]["content"] == ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                 '{"name": "get_time", "parameters": {"tz": "CET"}}')
    assert out[3]["content"] == "18 C, sunny\n14:05"
    out = messages_for_plain_template("mistral", CONVERSATION, None)
    assert out[0] == CONVERSATION[0]
    assert out[2]["content"] == ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                 '{"name": "get_time", "arguments": {"tz": "CET"}}]')
    assert out[3] == {"role": "user", "content": "[TOOL_RESULTS]18 C, sunny[/TOOL_RESULTS]"
                                                 "[TOOL_RESULTS]14:05[/TOOL_RESULTS]"}
    with_text = [{"role": "assistant", "content": "Sure.", "tool_calls": CONVERSATION[2]["tool_calls"][:1]}]
    assert messages_for_plain_template("hermes", with_text, None)[0]["content"] == (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    bad = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]
    with pytest.raises(ToolsError) as err:
        messages_for_plain_template("hermes", bad, None)
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"


def test_tools_system_prompts_list_the_schemas():
    functions = check_tools([WEATHER, TIME])
    hermes = tools_system_prompt("hermes", functions)
    assert hermes.startswith("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in hermes
    assert hermes.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    llama = tools_system_prompt("llama3_json", functions)
    assert '"parameters": dictionary of argument name and its value' in llama and json.dumps(TIME, indent=4) in llama
    mistral = tools_system_prompt("mistral", functions)
    assert mistral.startswith("[AVAILABLE_TOOLS]" + json.dumps([WEATHER, TIME]) + "[/AVAILABLE_TOOLS]")
    assert "[TOOL_CALLS][{" in mistral


# ---------------------------------------------------------------------------------- grammars

def _has(mask: np.ndarray, tok: int) -> bool:
    return bool((int(mask[tok >> 5]) >> (tok & 31)) & 1)


@pytest.fixture(scope="module")
def token_of(builtin_vocabulary, builtin_tokenizer):
    """bytes -> token id for every non-special token."""
    table: dict[bytes, int] = {}
    for tok in range(len(builtin_tokenizer)):
        if not builtin_vocabulary.tokenizer.is_special_token(tok):
            table.setdefault(builtin_vocabulary.tokenizer.decode_bytes([tok]), tok)
    return table


def walk(constraint, token_of, text: str) -> int:
    """Feed `text` through the constraint, each step the longest token the mask allows that
    spells the next bytes; returns the bytes consumed (len(text) when all is admitted)."""
    data, pos = text.encode(), 0
    longest = max(map(len, token_of))
    while pos < len(data):
        mask = constraint.mask()
        for size in range(min(longest, len(data) - pos), 0, -1):
            tok = token_of.get(data[pos:pos + size])
            if tok is not None and _has(mask, tok):
                constraint.advance([tok])
                pos += size
                break
        else:
            return pos
    return pos


WELL_FORMED = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>',
               '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
                    '; {"name": "get_time", "parameters": {"tz": "UTC"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
                ', {"name": "get_time", "arguments": {"tz": "UTC"}}'),
}


@pytest.mark.parametrize("parser", PARSERS)
def test_required_grammar_admits_calls_of_any_function_and_they_parse_back(parser, builtin_vocabulary,
                                                                           builtin_tokenizer, token_of):
    functions = check_tools([WEATHER, TIME])
    grammar = call_grammar(parser, functions, ToolChoice("required"))
    builtin_vocabulary.check(grammar)
    first, second = WELL_FORMED[parser]
    close = "]" if parser == "mistral" else ""
    eos = builtin_tokenizer.eos_token_id
    only_second = ("[TOOL_CALLS][" if parser == "mistral" else "") + second.lstrip("\n;, ")
    for text in (first + close, first + second + close, only_second + close):
        c = builtin_vocabulary.constraint(grammar)
        assert walk(c, token_of, text) == len(text.encode()), text
        assert _has(c.mask(), eos)  # the calls may end here
        content, calls = parse_tool_calls(parser, text, NAMES)
        assert content is None and [c.name for c in calls] == [n for n in NAMES if f'"{n}"' in text]
    c = builtin_vocabulary.constraint(grammar)
    assert walk(c, token_of, "Sure, let me check.") == 0  # text instead of a call is refused
    c = builtin_vocabulary.constraint(grammar)  # an argument outside the schema is refused where it starts
    bad = first.replace('"unit": "celsius"', '"unit": "kelvin"')
    assert walk(c, token_of, bad) == len(first[:first.index('"celsius"') + 1].encode())


@pytest.mark.parametrize("parser", PARSERS)
def test_named_grammar_forces_that_function_once(parser, builtin_vocabulary, builtin_tokenizer, token_of):
    functions = check_tools([WEATHER, TIME])
    grammar = call_grammar(parser, functions, ToolChoice("named", "get_weather"))
    builtin_vocabulary.check(grammar)
    first, second = WELL_FORMED[parser]
    close = "]" if parser == "mistral" else ""
    c = builtin_vocabulary.constraint(grammar)
    forced = builtin_tokenizer.decode(c.forced())
    key = "parameters" if parser == "llama3_json" else "arguments"
    assert forced.startswith(first[:first.index(key) + len(key) + 3])  # the name is forced, up to its arguments
    text = first + close
    c = builtin_vocabulary.constraint(grammar)
    assert walk(c, token_of, text) == len(text.encode())
    assert c.done or list(np.flatnonzero(np.unpackbits(c.mask().view(np.uint8), bitorder="little"))) == [
        builtin_tokenizer.eos_token_id]  # one call only: nothing but EOS may follow
    assert _calls(parse_tool_calls(parser, text, NAMES)[1]) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    # calling another function is refused where the name differs ('get_' is shared)
    other = text.replace('"get_weather", ', '"get_time", ').replace('{"city": "Oslo", "unit": "celsius"}',
                                                                    '{"tz": "UTC"}')
    c = builtin_vocabulary.constraint(grammar)
    assert walk(c, token_of, other) == len(text[:text.index("get_weather") + 4].encode())
    c = builtin_vocabulary.constraint(grammar)  # and so is a second call
    assert walk(c, token_of, first + second) == len(first.encode())


@pytest.mark.parametrize("parser", PARSERS)
def test_random_texts_the_grammar_admits_parse_back(parser, builtin_vocabulary, builtin_tokenizer):
    """Walk the grammar choosing uniformly among allowed tokens (EOS half the time it is allowed):
    whatever text it admits parses back into calls of the given functions, valid arguments."""
    functions = check_tools([WEATHER, TIME])
    eos = builtin_tokenizer.eos_token_id
    rng = np.random.default_rng(0)
    for choice in (ToolChoice("required"), ToolChoice("named", "get_time")):
        grammar = call_grammar(parser, functions, choice)
        for _ in range(4):
            c, out = builtin_vocabulary.constraint(grammar), []
            for _ in range(400):
                allowed = np.flatnonzero(np.unpackbits(c.mask().view(np.uint8), bitorder="little"))
                others = allowed[allowed != eos]
                if eos in allowed and (not len(others) or rng.random() < 0.5):
                    break
                tok = int(rng.choice(others))
                c.advance([tok])
                out.append(tok)
            else:
                pytest.fail("the walk did not end")
            text = builtin_tokenizer.decode(out)
            content, calls = parse_tool_calls(parser, text, NAMES)
            assert content is None and calls, text
            for call in calls:
                args = json.loads(call.arguments)
                if call.name == "get_weather":
                    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("celsius", "fahrenheit")
                else:
                    assert args == {"tz": args["tz"]} and args["tz"] in ("CET", "UTC")
            if choice.mode == "named":
                assert [call.name for call in calls] == ["get_time"]


def test_grammar_edge_cases(builtin_vocabulary):
    refs = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
        "$defs": {"num": {"type": "integer"}}}}}
    for parser in PARSERS:
        ping = {"type": "function", "function": {"name": "ping"}}
        builtin_vocabulary.check(call_grammar(parser, check_tools([refs, ping]), ToolChoice("required")))
    with pytest.raises(ValueError):
        call_grammar("hermes", check_tools([TIME]), ToolChoice("auto"))
    with pytest.raises(ToolsError) as err:
        call_grammar("hermes", check_tools([TIME]), ToolChoice("named", "get_weather"))
    assert err.value.param == "tool_choice.function.name"


def test_calls_cut_by_max_tokens_keep_the_complete_ones():
    """An answer cut at max_tokens inside its last call returns the calls before it (before: the
    whole answer came back as text, and smolagents' ToolCallingAgent failed every step on it)."""

    one = '{"name": "add", "arguments": {"a": 3, "b": 4}}'
    texts = {"hermes": f"<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{one[:20]}",
             "llama3_json": f"{one}; {one[:25]}",
             "mistral": f"[TOOL_CALLS][{one}, {one[:30]}"}
    for parser, text in texts.items():
        content, calls = parse_tool_calls(parser, text, ["add"], cut=True)
        assert [c.name for c in calls] == ["add"] and json.loads(calls[0].arguments) == {"a": 3, "b": 4}, parser
        assert parse_tool_calls(parser, text, ["add"])[1] == [], parser  # not cut: a broken answer stays text
