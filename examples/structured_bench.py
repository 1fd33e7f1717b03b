"""Structured output: text-to-SQL answers as JSON of a fixed schema, constrained plain decoding
against specx under the same grammar.

Each request is a chat over one Spider database: the schema and the answer format in the system
message, three earlier questions on the same database answered as JSON (the turns an agent's
history holds), then the new question. Every answer is decoded greedily under the JSON schema
{"sql": string, "tables": [string], "columns": [string]} (core.decode.grammar, llguidance), two ways on the same
requests: constrained plain decoding (one token a pass) and specx (suffix drafts from the
request and from earlier answers, the grammar's forced tokens first, refused nodes pruned,
cost-aware size). Every output is checked identical to constrained plain decoding's and
schema-valid. The first `--warmup` requests run untimed (first passes are slow; specx's global
index starts empty).

    .venv/bin/python examples/structured_bench.py [--requests 24] [--backend llama.cpp] [--json]

Needs ../shared/agent-data/text2sql-spider-dail-spider2 (or --spider FOLDER).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from specx.stack import assemble
from specx.core.cost.acceptance import AcceptanceModel
from specx.core.decode.generate import generate
from specx.core.decode.grammar import Vocabulary, json_schema_grammar
from specx.core.decode.loop import DecodeStats, collect
from specx.core.decode.request import Decoding
from specx.core.decode.speculate import SuffixDrafter
from specx.core.model.chat import chat_tokens
from specx.core.model.load import BACKENDS

HERE = Path(__file__).resolve().parent
DEFAULT_SPIDER = HERE.parent.parent / "shared" / "agent-data" / "text2sql-spider-dail-spider2"
SCHEMA = {"type": "object", "properties": {"sql": {"type": "string"},
                                           "tables": {"type": "array", "items": {"type": "string"}},
                                           "columns": {"type": "array", "items": {"type": "string"}}},
          "required": ["sql", "tables", "columns"], "additionalProperties": False}


def answer_json(sql: str, schema: dict) -> str:
    """A gold query as the JSON answer: the query, the tables and the columns it names."""
    words = set(sql.replace("(", " ").replace(")", " ").replace(",", " ").replace(".", " ").lower().split())
    tables = [t for t in schema["table_names_original"] if t.lower() in words]
    columns = list(dict.fromkeys(c for _, c in schema["column_names_original"][1:] if c.lower() in words))
    return json.dumps({"sql": sql.strip(), "tables": tables, "columns": columns})


def spider_chats(folder: Path, num: int, shots: int = 3) -> list[list[dict]]:
    """The first `num` dev questions with `shots` earlier ones on the same database, as chats."""
    dev = json.loads((folder / "spider_dev.json").read_text())
    schemas = {t["db_id"]: t for t in json.loads((folder / "spider_tables.json").read_text())}
    seen: dict[str, list[dict]] = {}
    chats = []
    for item in dev:
        earlier = seen.setdefault(item["db_id"], [])
        if len(earlier) >= shots:
            schema = schemas[item["db_id"]]
            tables = [f"{name}({', '.join(c for ti, c in schema['column_names_original'] if ti == t)})"
                      for t, name in enumerate(schema["table_names_original"])]
            system = (f"SQLite database {item['db_id']}: " + "; ".join(tables) + ". Answer each question with JSON: "
                      '{"sql": the SQL query, "tables": the tables it reads, "columns": the columns it names}.')
            chat = [{"role": "system", "content": system}]
            for ex in earlier[len(earlier) - shots :]:
                chat += [{"role": "user", "content": ex["question"]},
                         {"role": "assistant", "content": answer_json(ex["query"], schema)}]
            chats.append(chat + [{"role": "user", "content": item["question"]}])
            if len(chats) == num:
                break
        earlier.append(item)
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24, help="timed requests (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=8, help="requests run first, untimed")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--backend", default="transformers", choices=BACKENDS,
                        help="what runs the built-in model (llama.cpp: its GGUF as it ships)")
    parser.add_argument("--dtype", default=None, help="weights dtype on transformers: float32, bfloat16 "
                        "(default: float32 on CPU, bfloat16 on a GPU; lossless holds in float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no Spider data in {args.spider} (give --spider FOLDER with spider_dev.json)")
    torch.set_grad_enabled(False)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    stack = assemble("smollm2-135m", backend=args.backend, dtype=args.dtype, say=say, speculation=False)
    net, tok, cost = stack.engine, stack.tokenizer, stack.cost
    vocabulary = Vocabulary(tok, net.vocab_size, tok.eos_token_id)
    settings = Decoding(max_new_tokens=args.max_new_tokens, eos_token_ids=tok.eos_token_id,
                        grammar=json_schema_grammar(SCHEMA))
    prompts = []
    for chat in spider_chats(args.spider, args.warmup + args.requests):
        prompts.append(chat_tokens(tok, chat))
    drafter = SuffixDrafter()  # one global index for all requests, as the server has
    methods = {"constrained_plain": None, "specx": drafter}
    rows, outputs = {}, {}
    for name, method in methods.items():
        stats, seconds, outs, acceptance = DecodeStats(), 0.0, [], AcceptanceModel()
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            run = collect(generate(net, prompt, method, settings, constraint=settings.constraint(vocabulary),
                                   cost=cost if method is not None else None, acceptance=acceptance,
                                   prefix_cache=net.new_prefix_cache(0)))
            out, request = run.tokens, run.stats
            if i >= args.warmup:
                stats.add(request)
                seconds += time.perf_counter() - t0
                outs.append(out)
            say(f"{name} {i + 1}/{len(prompts)}{'' if i >= args.warmup else ' (warm-up)'}: {len(out)} tokens, "
                f"{request.steps} passes")
        outputs[name] = outs
        finished = [o for o in outs if o and o[-1] == tok.eos_token_id]  # the rest hit --max-new-tokens
        rows[name] = {"tokens": stats.tokens, "seconds": seconds, "tokens_per_s": stats.tokens / seconds,
                      "steps": stats.steps, "tokens_per_step": stats.tokens / stats.steps,
                      "finished": len(finished), "finished_schema_valid": sum(_valid(tok.decode(o[:-1])) for o in finished)}
    for name, row in rows.items():
        row["speedup_vs_constrained_plain"] = row["tokens_per_s"] / rows["constrained_plain"]["tokens_per_s"]
        row["identical"] = sum(a == b for a, b in zip(outputs[name], outputs["constrained_plain"]))
    report = {"requests": args.requests, "warmup": args.warmup, "backend": net.name,
              "schema": SCHEMA, "methods": rows,
              "example_output": tok.decode(outputs["specx"][0])}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'method':<20}{'tokens/s':>10}{'tokens/step':>13}{'speedup':>9}{'identical':>11}{'valid/finished':>16}")
    for name, row in rows.items():
        print(f"{name:<20}{row['tokens_per_s']:>10.1f}{row['tokens_per_step']:>13.2f}"
              f"{row['speedup_vs_constrained_plain']:>8.2f}x{row['identical']:>8}/{args.requests}"
              f"{row['finished_schema_valid']:>10}/{row['finished']}")
    print("higher is better; identical: to constrained plain decoding, token for token; valid/finished: "
          "schema-valid answers among those that ended before --max-new-tokens")


def _valid(text: str) -> bool:
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return (isinstance(answer, dict) and set(answer) == set(SCHEMA["required"]) and isinstance(answer["sql"], str)
            and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                    for v in (answer["tables"], answer["columns"])))


if __name__ == "__main__":
    main()
