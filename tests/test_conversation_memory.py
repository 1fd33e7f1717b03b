"""Conversations kept across their turns (`specx serve --kv-memory`): a real server on loopback, the
quantized engine, the official openai client. An agent's next turn resends the conversation: it
prefills only what the turn added; when the budget is full a conversation
is pushed out (counted in /metrics) and nothing fails."""

import urllib.request

import openai
import pytest

from helpers.servers import MODEL, Server, specx_home

KEY = "memory-key"
# the built-in model's cache a token: 30 layers, 3 key heads of 64 dimensions, int8 keys (two 32-dimension
# blocks of 32 bytes and a float32 scale each) and float16 values
PER_TOKEN = 30 * 3 * (2 * (32 + 4) + 64 * 2)
BUDGET_TOKENS = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(specx_home(tmp_path_factory), tmp_path_factory.mktemp("memory") / "memory.db", "--api-key", KEY,
                 "--backend", "quantized", "--kv-memory", str(BUDGET_TOKENS * PER_TOKEN), "--max-batch", "1")
    yield srv
    srv.stop()


def _metric(srv, name: str) -> float:
    req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + " "))


def _turn(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int, int]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    usage = answer.usage
    return answer.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


@pytest.mark.slow
def test_turns_reuse_the_conversation_and_a_full_budget_pushes_the_oldest_out(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert f"= {BUDGET_TOKENS:,} tokens" in server.log()
    a = [{"role": "system", "content": "Agent A. " + "The build log says: compiling module alpha. " * 20},
         {"role": "user", "content": "What failed?"}]
    text, prompt_1, _ = _turn(client, a)
    a += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then? " * 10}]
    _, prompt_2, cached_2 = _turn(client, a)
    assert cached_2 >= prompt_1 - 1  # the whole first turn came from memory: only the new turn was prefilled
    assert _metric(server, "specx_kv_evicted_tokens") == 0
    b = [{"role": "system", "content": "Agent B. " + "Another repository, another story entirely. " * 60},
         {"role": "user", "content": "Summarise."}]
    _, prompt_b, _ = _turn(client, b)
    assert prompt_b + prompt_2 > BUDGET_TOKENS
    assert _metric(server, "specx_kv_evicted_tokens") >= prompt_2 - 1  # A's conversation went
    assert 0 < _metric(server, "specx_kv_memory_tokens") <= BUDGET_TOKENS
    _, prompt_3, cached_3 = _turn(client, a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go"}])
    assert cached_3 < prompt_1 // 2  # prefilled again (at most the chat template's opening is shared with B)
