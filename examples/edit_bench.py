"""An edit task with OpenAI-style Predicted Outputs: the model rewrites a file, the file is the prediction.

Each task asks the built-in model to rename one identifier in a short Python file and answer with
the whole file; the prediction is the file as it was (what a code-editing agent sends). Greedy,
three ways on the same requests: plain decoding, specx without the prediction (its request index
still holds the file, from the prompt) and specx with it (core.decode.speculate.PredictionDrafter first).
Every output is checked identical to plain decoding's.

    .venv/bin/python examples/edit_bench.py [--backend llama.cpp] [--json]
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
from specx.core.decode.loop import DecodeStats, collect
from specx.core.decode.request import Decoding
from specx.core.decode.speculate import PredictionDrafter, SuffixDrafter
from specx.core.model.chat import chat_tokens
from specx.core.model.load import BACKENDS
from specx.core.serve.job import prediction_tokens

HERE = Path(__file__).resolve().parent
# Files of this repository (MIT, ours), cut to a function or two each; (path, start line, lines, old, new).
TASKS = [("core/index/sealed.py", "class Segment:", 35, "Segment", "Block"),
         ("core/draft.py", "def add_guesses(", 22, "draft", "tree"),
         ("core/draft.py", "def subtree(", 10, "keep", "mask"),
         ("examples/quickstart.py", "past_outputs = [", 14, "past_outputs", "history")]


def task_text(path: str, start: str, lines: int) -> str:
    text = (HERE.parent / path).read_text().splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith(start))
    return "\n".join(text[first : first + lines]).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default=None, help="weights dtype: float32, bfloat16 (default: float32 on CPU, "
                        "bfloat16 on a GPU; lossless holds in float32)")
    parser.add_argument("--backend", default="transformers", choices=BACKENDS,
                        help="what runs the built-in model (llama.cpp: its GGUF as it ships)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    stack = assemble("smollm2-135m", backend=args.backend, dtype=args.dtype, say=lambda m: print(m, file=sys.stderr),
                     speculation=False)  # each method makes its drafter
    net, tok, cost = stack.engine, stack.tokenizer, stack.cost
    requests = []
    for path, start, lines, old, new in TASKS:
        code = task_text(path, start, lines)
        ask = (f"Here is a Python file:\n```python\n{code}```\nRename `{old}` to `{new}` everywhere. Reply with the "
               f"whole updated file in one code block and nothing else.")
        prompt = chat_tokens(tok, [{"role": "user", "content": ask}])
        prediction = tok.encode(f"```python\n{code}```", add_special_tokens=False)
        requests.append((prompt, prediction, len(prediction) + 32))
    methods = {"plain": lambda p: None, "specx": lambda p: SuffixDrafter(),
               "specx_prediction": lambda p: PredictionDrafter(p, SuffixDrafter())}
    generate(net, requests[0][0][-8:], None, Decoding(max_new_tokens=2))  # first passes are slow
    rows, outputs = {}, {}
    for name, make in methods.items():
        stats, seconds, outs, accepted = DecodeStats(), 0.0, [], 0
        acceptance = AcceptanceModel()  # shared by the requests, as the server shares it
        for prompt, prediction, limit in requests:
            t0 = time.perf_counter()
            run = collect(generate(net, prompt, make(prediction), Decoding(max_new_tokens=limit,
                                                                           eos_token_ids=tok.eos_token_id),
                                   cost=cost if name != "plain" else None, acceptance=acceptance,
                                   prefix_cache=net.new_prefix_cache(0)))
            stats.add(run.stats)
            out = run.tokens
            seconds += time.perf_counter() - t0
            outs.append(out)
            accepted += prediction_tokens(prediction, out)[0]
        outputs[name] = outs
        rows[name] = {"tokens": stats.tokens, "seconds": seconds, "tokens_per_s": stats.tokens / seconds,
                      "steps": stats.steps, "tokens_per_step": stats.tokens / stats.steps,
                      "prediction_tokens_in_output": accepted,
                      "prediction_tokens": sum(len(p) for _, p, _ in requests)}
        print(f"{name}: {rows[name]['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    for name, row in rows.items():
        row["speedup_vs_plain"] = row["tokens_per_s"] / rows["plain"]["tokens_per_s"]
        row["identical"] = sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
    report = {"tasks": len(requests), "backend": net.name, "methods": rows,
              "example_output": tok.decode(outputs["plain"][0])[:300]}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'method':<18}{'tokens/s':>10}{'tokens/step':>13}{'speedup':>9}{'identical':>11}")
    for name, row in rows.items():
        print(f"{name:<18}{row['tokens_per_s']:>10.1f}{row['tokens_per_step']:>13.2f}{row['speedup_vs_plain']:>8.2f}x"
              f"{row['identical']:>8}/{len(requests)}")
    share = rows["plain"]["prediction_tokens_in_output"] / rows["plain"]["prediction_tokens"]
    print(f"higher is better; {share:.0%} of the prediction's tokens appear in the answers")


if __name__ == "__main__":
    main()
