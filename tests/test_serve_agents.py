"""`specx serve` for agents, with real clients on loopback: structured output (response_format),
logprobs, tool calls. The server is conftest's `server` (`python -m specx serve`, the built-in model),
shared with test_serve.py."""

import json

import pytest

from helpers.cli import specx_in_process, specx_test_home
from helpers.servers import KEY, MODEL, Server

SQL_SYSTEM = ("Tables: singer(singer_id, name, country, age), concert(concert_id, year, stadium_id), "
              "stadium(stadium_id, name, capacity). Answer with JSON: the SQL query and the tables it reads, "
              'e.g. {"sql": "SELECT name FROM singer", "tables": ["singer"]}.')


@pytest.fixture(scope="module")
def reference(builtin_model):
    """Constrained plain greedy decoding with the same model, in this process: what the server must write."""
    from specx.core.decode.generate import greedy_decode
    from specx.core.decode.grammar import Vocabulary

    model, tokenizer = builtin_model
    vocabulary = Vocabulary(tokenizer, model.config.vocab_size, tokenizer.eos_token_id)

    def decode(prompt_ids, grammar, max_tokens):
        out = greedy_decode(model, prompt_ids, max_tokens, tokenizer.eos_token_id, vocabulary.constraint(grammar))
        return tokenizer.decode(out[:-1] if out and out[-1] == tokenizer.eos_token_id else out)

    return decode


def tokenize(server, messages):
    from helpers.servers import post

    status, body = post(server.url + "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200, body
    return body["tokens"]


def test_parse_with_a_pydantic_model_is_schema_valid_and_lossless(server, reference):
    from pydantic import BaseModel

    from specx.core.decode.grammar import json_schema_grammar

    class Query(BaseModel):
        sql: str
        tables: list[str]

    client = server.client()
    for question in ("List singers older than 30.", "How many concerts were held in 2014?",
                     "Which stadium has the largest capacity?"):
        messages = [{"role": "system", "content": SQL_SYSTEM}, {"role": "user", "content": question}]
        answer = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Query,
                                               temperature=0, max_tokens=200)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Query), choice.message.content
        # the schema the SDK sent (strict: additionalProperties false, every key required), decoded without the server
        schema = Query.model_json_schema() | {"additionalProperties": False, "required": ["sql", "tables"]}
        want = reference(tokenize(server, messages), json_schema_grammar(schema), 200)
        assert choice.message.content == want


def test_json_object_and_streaming_under_a_schema(server):
    client = server.client()
    messages = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120,
                                            response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120,
                                           response_format=fmt)
    parts = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120,
                                           response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content
    cat = json.loads(text)
    assert set(cat) == {"name", "age"} and isinstance(cat["age"], int)


def test_a_bad_schema_is_a_400_that_names_it(server):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "no-such-type" in err.value.body["message"]


def test_logprobs_chat_stream_and_completions(server):
    import math

    client = server.client()
    messages = [{"role": "user", "content": "Count from 1 to 10."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    for t in content:  # greedy: each token is its position's most likely one
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob <= 0 and math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-6)
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                          max_tokens=24, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs]
    tokens = [t for c in streamed for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in content]
    # the same tokens, verified in other draft trees: float32 sums in another order
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=2e-3) for a, b in zip(tokens, content))
    assert whole.choices[0].logprobs is not None
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4).choices[0].logprobs is None
    raw = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=8, temperature=0, logprobs=2)
    lp = raw.choices[0].logprobs
    assert "".join(lp.tokens) == raw.choices[0].text and len(lp.token_logprobs) == 8
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_required_and_named_give_calls_of_the_tools(server):
    client = server.client()
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                temperature=0, max_tokens=120)
        c = answer.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
        for call in c.message.tool_calls:
            assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            assert isinstance(args["city"], str)
            if call.function.name == "get_weather":
                assert args["unit"] in ("C", "F")


def test_parallel_tool_calls_false_gives_one_call(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_tokens=120)
    many = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0].message.tool_calls
    assert len(many) > 1 and len(one) == 1  # the 135M model repeats its call until told not to
    assert (one[0].function.name, one[0].function.arguments) == (many[0].function.name, many[0].function.arguments)


def test_streamed_tool_calls_equal_the_whole_answer_and_history_renders(server):
    client = server.client()
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=120,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:  # as the SDK's accumulators read them
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # the call text is not content
    # the answer back, as an agent sends it: the call in the history and the tool's result
    call = whole.message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_auto_leaves_a_text_answer_as_text(server):
    # the built-in 135M model answers these in words (it never calls a tool unasked): content, finish "stop";
    # parsing of calls the model writes itself is tested on recorded texts (test_tools.py, test_http_responses.py)
    client = server.client()
    for messages in ([{"role": "user", "content": "Say hello."}], ASK):
        for stream in (False, True):
            answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                    max_tokens=60, stream=stream)
            if stream:
                chunks = [c for c in answer if c.choices]
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                assert not any(c.choices[0].delta.tool_calls for c in chunks)
                assert chunks[-1].choices[0].finish_reason == "stop" and text == whole
            else:
                whole = answer.choices[0].message.content
                assert answer.choices[0].finish_reason == "stop" and whole and not answer.choices[0].message.tool_calls


# --------------------------------------------------------------------------- the agent frameworks, as they are

def test_langchain_bind_tools_and_with_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return "18 C"

    class Query(BaseModel):
        sql: str
        tables: list[str]

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=120)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    query = llm.with_structured_output(Query).invoke([("system", SQL_SYSTEM), ("user", "List singers older than 30.")])
    assert isinstance(query, Query) and query.sql.upper().startswith("SELECT")


def test_litellm_tool_choice_required(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    import litellm

    answer = litellm.completion(model="openai/" + MODEL, api_base=server.url + "/v1", api_key=KEY, messages=ASK,
                                tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=120)
    calls = answer.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    assert json.loads(calls[0].function.arguments)["unit"] in ("C", "F")


def test_smolagents_tool_calling_agent_calls_the_tool(server):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    asked: list[str] = []

    @tool
    def weather(city: str) -> str:
        """The weather in a city now.

        Args:
            city: the city's name
        """
        asked.append(city)
        return "18 C, sunny"

    model = OpenAIServerModel(model_id=MODEL, api_base=server.url + "/v1", api_key=KEY, max_tokens=120, temperature=0)
    agent = ToolCallingAgent(tools=[weather], model=model, max_steps=1, verbosity_level=0)
    answer = agent.run("What is the weather in Paris?")  # one step (tool_choice "required"), then a final answer
    assert asked and all(isinstance(city, str) and city for city in asked)
    assert isinstance(answer, str) and answer


# --------------------------------------------------------------------------- models that cannot verify trees

@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    """A tiny random Gemma 3 (sliding-window layers) over the built-in tokenizer, as an HF folder."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from specx.core.model.load import load_tokenizer

    folder = tmp_path_factory.mktemp("gemma3-tiny")
    tokenizer = load_tokenizer(MODEL, specx_test_home(tmp_path_factory) / "models")
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow  # a server of its own
def test_a_sliding_window_model_verifies_linear_drafts_decided_at_load(windowed_model, tmp_path, tmp_path_factory):
    run = specx_in_process("generate", "Count to ten.", "--model", str(windowed_model), "--max-tokens", "12", "--json",
                           "--compare", "--db", str(tmp_path / "none.db"))
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert "linear drafts (each tree's best path)" in run.stderr and result["tokens"] == 12 and result["identical"]
    srv = Server(str(specx_test_home(tmp_path_factory)), tmp_path / "served.db", "--model", str(windowed_model))
    try:
        client = srv.client()
        for _ in range(2):  # every request answers, none is a 500
            answer = client.chat.completions.create(model=str(windowed_model), max_tokens=30, temperature=0,
                                                    messages=[{"role": "user", "content": "Count to ten."}])
            assert answer.usage.completion_tokens >= 1
        assert "linear drafts (each tree's best path)" in srv.log() and "speculation on" in srv.log()
    finally:
        srv.stop()
