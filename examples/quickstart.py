"""Draft from past agent outputs: build a suffix index over a few tool calls, then speculate.

    .venv/bin/python examples/quickstart.py
"""

from specx.core.decode.speculate import SuffixDrafter
from specx.core.index.suffix_index import SuffixIndex
from specx.core.model.load import load_tokenizer

past_outputs = [
    '{"name": "execute_sql", "arguments": {"query": "SELECT name FROM singer WHERE age > 30"}}',
    '{"name": "execute_sql", "arguments": {"query": "SELECT count(*) FROM concert WHERE year = 2014"}}',
    '{"name": "read_file", "arguments": {"path": "src/main/java/com/google/gson/Gson.java"}}',
]
tokenizer = load_tokenizer()  # the built-in SmolLM2 tokenizer (converted from GGUF once, then cached)
index = SuffixIndex.build([tokenizer.encode(text) for text in past_outputs])
print(f"indexed {index.num_tokens} tokens in {index.nbytes} bytes")

drafter = SuffixDrafter(index, max_spec_factor=4.0)
prompt = tokenizer.encode("List the singers older than 40 as a tool call.")
output = tokenizer.encode('{"name": "execute_sql", "arguments": {"query": "')
drafter.start_request(prompt)
drafter.extend(output)
draft = drafter.speculate()
print("context ends with:", repr(tokenizer.decode(output[-6:])))
print(f"draft ({len(draft)} tokens, expected accepted {draft.score:.2f}, match length {draft.match_len}):")
for path in draft.paths():
    print("  ", repr(tokenizer.decode(path)))
