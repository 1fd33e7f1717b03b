"""Issue 53's device check: specx's GPU engine (core/model/gpu/) on a lent GPU, one JSON of figures.

    python examples/gpu_check.py --out gpu_check.json                 # on the GPU (H100/H200), ~10 minutes
    python examples/gpu_check.py --dry-run --out /tmp/dry.json        # anywhere: a tiny model in Triton's interpreter

For each model (the built-in SmolLM2-135M when its package holds the weights, else a random-weight
GGUF of its shape; a random-weight Llama-3.2-1B shape, both by examples/model_ladder.py's writer):

- lossless: greedy and sampled (temperature 0.8, top-p 0.95, seeded), each request alone and 16
  in one batch (score_batch: one pass over all their rows), with draft trees that hold the right
  path among wrong siblings (an oracle drafter built from the plain output, so trees are accepted
  on random weights too): every output must equal the engine's own plain decoding;
- pass cost after 600 cached tokens: one request, 1 to 32 tree rows; 16 requests of 1 and 4 rows;
- beside it: transformers' own `generate` in bfloat16 on the same GPU (greedy, and its prompt
  lookup), and the GPU engine's plain and suffix-speculation decoding, tokens/s on the same prompts.
  On random weights no acceptance or speed-up figure means anything (the JSON marks such models).

Every part is timed against --budget-s and skipped (named in "skipped") when the time is short.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=0)
TINY = dict(hidden=64, ffn=128, heads=4, kv_heads=2, vocab=128)  # the dry run's random model (F32, no tokenizer)


class OracleDrafter:
    """Draft trees from a known continuation: the right path (a random depth) with wrong siblings
    and their children beside each right node, and some noise: partial acceptance at every depth."""

    def __init__(self, reference: list[int], vocab: int, seed: int = 0) -> None:
        self.reference, self.vocab, self.rng = reference, vocab, random.Random(seed)
        self.output: list[int] = []

    def start_request(self, prompt: list[int]) -> None:
        self.output = []

    def extend(self, tokens: list[int]) -> None:
        self.output.extend(tokens)

    def finish_request(self, learn: bool = True) -> None:
        pass

    def speculate(self, context: object = None) -> object:
        return oracle_tree(self.rng, self.output, self.reference, self.vocab)


def oracle_tree(rng: random.Random, out: list[int], reference: list[int], vocab: int) -> object:
    from specx.core.draft import Draft

    right = reference[len(out) : len(out) + rng.randrange(0, 10)]
    tokens, parents, parent = [], [], -1
    for tok in right:
        for _ in range(rng.randrange(0, 3)):
            tokens.append((tok + rng.randrange(1, vocab)) % vocab)
            parents.append(parent)
            tokens.append(rng.randrange(vocab))
            parents.append(len(tokens) - 2)
        tokens.append(tok)
        parents.append(parent)
        parent = len(tokens) - 1
    return Draft(tokens, parents, [0.5] * len(tokens), 0.5 * len(tokens), 1)


def sampled_plain(engine: object, prompt: list[int], n: int, seed: int) -> list[int]:
    from specx.core.decode.generate import generate
    from specx.core.decode.loop import collect
    from specx.core.decode.request import Decoding

    return collect(generate(engine, prompt, None, Decoding(max_new_tokens=n, seed=seed, **SAMPLED))).tokens


def lossless_alone(engine: object, prompts: list[list[int]], n: int) -> dict:
    """Each prompt alone: speculation with oracle trees against plain decoding, greedy and sampled."""
    from specx.core.decode.generate import generate
    from specx.core.decode.loop import collect
    from specx.core.decode.request import Decoding

    report = {"greedy_identical": 0, "sampled_identical": 0, "requests": len(prompts), "tokens_per_step": []}
    for i, prompt in enumerate(prompts):
        plain = engine.plain(prompt, n, None)
        spec = collect(generate(engine, prompt, OracleDrafter(plain, engine.vocab_size, i), Decoding(max_new_tokens=n)))
        report["greedy_identical"] += spec.tokens == plain
        report["tokens_per_step"].append(round(len(spec.tokens) / max(spec.stats.steps, 1), 2))
        plain = sampled_plain(engine, prompt, n, seed=i)
        spec = collect(generate(engine, prompt, OracleDrafter(plain, engine.vocab_size, i),
                                Decoding(max_new_tokens=n, seed=i, **SAMPLED)))
        report["sampled_identical"] += spec.tokens == plain
    return report


def batch_decode(engine: object, prompts: list[list[int]], references: list[list[int]], n: int,
                 seeds: list[int] | None) -> tuple[list[list[int]], int]:
    """Decode the prompts together, one score_batch pass per step over all requests' trees (greedy,
    or sampled with each request's own seeded generator, as `generate` makes it)."""
    import torch

    from specx.core.decode.verify import Sampling, judge

    samplings = [Sampling() if seeds is None else Sampling(SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"],
                                                            torch.Generator().manual_seed(s)) for s in
                 (seeds or [0] * len(prompts))]
    sessions = [engine.start(p[:-1]) for p in prompts]
    pending = [[p[-1]] for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    rngs = [random.Random(i) for i in range(len(prompts))]
    passes = 0
    while True:
        live = [i for i in range(len(prompts)) if len(outs[i]) < n]
        if not live:
            return outs, passes
        drafts = [oracle_tree(rngs[i], outs[i], references[i], engine.vocab_size) for i in live]
        logits = engine.score_batch([sessions[i] for i in live], [pending[i] for i in live], drafts)
        passes += 1
        for i, rows, draft in zip(live, logits, drafts):
            verdict = judge(rows, draft, samplings[i])
            sessions[i].keep_path(verdict.accepted_nodes)
            outs[i] = (outs[i] + verdict.tokens)[:n]
            pending[i] = [verdict.tokens[-1]]


def lossless_batched(engine: object, prompts: list[list[int]], n: int, batch: int) -> dict:
    prompts = [prompts[i % len(prompts)] + [i + 1] for i in range(batch)]  # 16 requests, no two alike
    greedy = [engine.plain(p, n, None) for p in prompts]
    sampled = [sampled_plain(engine, p, n, seed=i) for i, p in enumerate(prompts)]
    got_greedy, passes = batch_decode(engine, prompts, greedy, n, None)
    got_sampled, _ = batch_decode(engine, prompts, sampled, n, list(range(batch)))
    return {"requests": batch, "greedy_identical": sum(a == b for a, b in zip(got_greedy, greedy)),
            "sampled_identical": sum(a == b for a, b in zip(got_sampled, sampled)), "greedy_passes": passes}


def timed(run: object, repeats: int) -> float:
    """Median milliseconds of `run()` (which returns once the GPU is done: logits come to the host)."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - started))
    return round(statistics.median(times), 3)


def pass_cost(engine: object, context: int, rows: list[int], repeats: int) -> dict:
    """ms of a pass after `context` cached tokens: one request with 1..N tree rows (a chain), and
    16 requests with 1 and 4 rows each."""
    from specx.core.draft import Draft

    rng = random.Random(0)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(context)]
    session = engine.start(prompt)

    def chain(k: int) -> Draft:  # the pending token and k - 1 draft tokens in a line: k rows
        return Draft(list(range(1, k)), list(range(-1, k - 2)), [0.5] * (k - 1), 0.5, 1)

    def one(k: int) -> None:
        session.score([5], chain(k))
        session.keep_path([])  # the cache grows by one a pass: a few tokens over `context`

    report = {"context": context, "one_request_ms": {str(k): timed(lambda k=k: one(k), repeats) for k in rows}}
    sessions = [engine.start(prompt[: context - i]) for i in range(16)]
    for k in (1, 4):
        def batch(draft: Draft = chain(k)) -> None:
            engine.score_batch(sessions, [[5]] * 16, [draft] * 16)
            for s in sessions:
                s.keep_path([])

        report[f"16_requests_{k}_rows_ms"] = timed(batch, repeats)
    return report


def speeds(engine: object, path: Path, prompts: list[list[int]], n: int, eos: int | None, hf: bool) -> dict:
    """tokens/s on the same prompts: the GPU engine's plain and suffix speculation; transformers'
    greedy `generate` and its prompt lookup in bfloat16 on the same GPU (`hf`)."""
    from specx.core.decode.generate import generate
    from specx.core.decode.loop import collect
    from specx.core.decode.request import Decoding
    from specx.core.decode.speculate import SuffixDrafter

    def rate(run: object) -> dict:
        outs, started = [], time.perf_counter()
        for p in prompts:
            outs.append(run(p))
        seconds = time.perf_counter() - started
        return {"tokens_per_s": round(sum(map(len, outs)) / seconds, 1), "outputs": outs}

    settings = Decoding(max_new_tokens=n, eos_token_ids=eos)
    report = {"gpu plain": rate(lambda p: engine.plain(p, n, eos)),
              "gpu specx suffix": rate(lambda p: collect(generate(engine, p, SuffixDrafter(), settings)).tokens)}
    if hf:
        from specx.core.model.transformers.engine import hf_generate
        from specx.core.model.load import load_model

        started = time.perf_counter()
        net, _ = load_model(str(path), Path("/tmp/specx-gpu-check-models"), device="cuda", dtype="bfloat16",
                            kernels=False)
        report["transformers load s"] = round(time.perf_counter() - started, 1)
        hf_generate(net, prompts[0], 4, eos)  # warm-up
        report["transformers generate"] = rate(lambda p: hf_generate(net, p, n, eos))
        report["transformers prompt lookup"] = rate(lambda p: hf_generate(net, p, n, eos, prompt_lookup_num_tokens=10))
        del net
    base = report["gpu plain"]["outputs"]
    for name, figures in report.items():
        if isinstance(figures, dict):
            figures["identical_to_gpu_plain"] = sum(a == b for a, b in zip(figures.pop("outputs"), base))
    return report


def model_file(name: str, folder: Path) -> tuple[Path, bool]:
    """(GGUF path, real weights?) of `name`: "builtin" (its package's file when it holds weights,
    else a random 135M-shape file) or a model_ladder shape, written in F16 (no quantizer needed)."""
    import gguf

    from specx.core.model.load import builtin_gguf

    if name == "builtin":
        path = builtin_gguf("smollm2-135m")
        if gguf.GGUFReader(path).tensors:
            return path, True
        name = "135m"
    sys.path.insert(0, str(HERE))
    from model_ladder import write_random

    target = folder / f"random-{name}-F16.gguf"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_random(name, "F16", target.with_suffix(".part"))
        target.with_suffix(".part").replace(target)
    return target, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON written (after each part, so a cut run keeps "
                                                                "what it measured)")
    parser.add_argument("--models", default="builtin,1b", help="builtin and/or model_ladder shapes (135m, 1b, 3b)")
    parser.add_argument("--tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--budget-s", type=float, default=480, help="parts that would start after this are skipped")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/specx-gpu-check"), help="where GGUFs are written")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU tensors in Triton's interpreter")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton defines the kernels
    import torch
    from gguf import GGMLQuantizationType

    from specx.core.model.gpu.engine import GPUEngine
    from specx.core.model.random_gguf import tiny_gguf

    started = time.perf_counter()
    result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "torch": torch.__version__, "dry_run": args.dry_run, "models": {}, "skipped": []}

    def save() -> None:
        result["seconds"] = round(time.perf_counter() - started, 1)
        args.out.write_text(json.dumps(result, indent=1))

    def part(model: dict, name: str, run: object, share: float = 0.0) -> None:
        if time.perf_counter() - started > args.budget_s * (1 - share):
            result["skipped"].append(f"{model['name']}: {name}")
            return
        t = time.perf_counter()
        try:
            model[name] = run()
        except Exception as exc:  # noqa: BLE001 - one part's failure is a figure too; the others go on
            model[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        model[name + " s"] = round(time.perf_counter() - t, 1)
        print(f"gpu_check: {model['name']}: {name}: {json.dumps(model[name])[:300]}", file=sys.stderr, flush=True)
        save()

    names = ["tiny"] if args.dry_run else args.models.split(",")
    n = 4 if args.dry_run else args.tokens
    for name in names:
        if args.dry_run:
            args.folder.mkdir(parents=True, exist_ok=True)
            path, real = tiny_gguf(args.folder / "tiny.gguf", GGMLQuantizationType.F32, **TINY), False
            prompts, eos = [[1, 2, 3, 4], [9, 8, 7]], None
        else:
            path, real = model_file(name, args.folder)
            from specx.trial import PROMPTS
            from specx.core.model.load import load_tokenizer

            tok = load_tokenizer("smollm2-135m", Path("/tmp/specx-gpu-check-models"))
            prompts, eos = [tok.encode(p) for p in PROMPTS], tok.eos_token_id
        model: dict = {"name": name, "file": str(path), "real_weights": real}
        result["models"][name] = model
        t = time.perf_counter()
        engine = GPUEngine(path, device=None if not args.dry_run else "cpu")
        model["load s"], model["compile s"] = round(time.perf_counter() - t, 1), round(engine.compile_seconds, 1)
        model["kernels"] = engine.kernels
        part(model, "lossless alone", lambda: lossless_alone(engine, prompts[:3], n))
        part(model, "lossless batch of 16", lambda: lossless_batched(engine, prompts, n, 3 if args.dry_run else 16))
        part(model, "pass cost", lambda: pass_cost(engine, 20 if args.dry_run else 600,
                                                  [1, 2] if args.dry_run else [1, 2, 4, 8, 16, 32], 1 if args.dry_run
                                                  else 10), share=0.1)
        part(model, "tokens per second", lambda: speeds(engine, path, prompts, n, eos, hf=not args.dry_run), share=0.2)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()
    print(args.out)


if __name__ == "__main__":
    main()
