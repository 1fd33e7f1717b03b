"""Response bodies of `specx serve` (cli/http/responses.py) without a server: a streamed answer that
holds tool calls is sent as content up to the call, then as tool-call deltas."""

import json
import random

import pytest

from specx.http.responses import HeldText
from specx.core.decode.request import Decoding
from specx.core.serve.tool_calls import parse_tool_calls
from specx.core.serve.job import GenerationRequest

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {  # recorded answers in each format, and whether they hold calls
    "hermes": [("Let me check. " + CALL, True), (CALL + "\n" + CALL.replace("Paris", "Oslo"), True),
               ("The weather is fine; no <tool_ here.", False), ("<tool_call>\n{broken", False), ("", False)],
    "llama3_json": [('{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
                    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
                    ('Sure: {"a": 1} is JSON.', False), ('  {"name": "other", "parameters": {}}', False)],
    "mistral": [('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', True),
                ("I think [TOOL_CALLS] is a marker, not a call.", False)],
}


def request(parser):
    return GenerationRequest(id="x", endpoint="chat.completions", model="m", prompt_ids=[1],
                             settings=Decoding(max_new_tokens=1), tool_parser=parser, tool_names=["get_weather"])


@pytest.mark.parametrize("parser", list(TEXTS))
def test_held_text_sends_content_then_calls_however_the_text_is_cut(parser):
    rng = random.Random(0)
    for text, has_calls in TEXTS[parser]:
        content, calls = parse_tool_calls(parser, text, ["get_weather"])
        assert bool(calls) == has_calls, text
        for _ in range(20):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 6))))
            held = HeldText(request(parser))
            sent = "".join(held.push(text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)]))
            rest, deltas, got = held.finish()
            if has_calls:
                assert rest == "" and sent.strip() == (content or "")  # the text before the call went out
                streamed = [d["tool_calls"][0] for d in deltas]
                assert [(d["function"]["name"], json.loads(d2["function"]["arguments"]))
                        for d, d2 in zip(streamed[::2], streamed[1::2])] == \
                    [(c.name, json.loads(c.arguments)) for c in calls]
                assert [d["index"] for d in streamed] == [k for k in range(len(calls)) for _ in range(2)]
            else:
                assert sent + rest == text and deltas == [] and got == []


def test_without_tools_text_goes_out_at_once():
    held = HeldText(request(None))
    assert held.push("<tool_call>") == "<tool_call>" and held.finish() == ("", [], [])
