"""What specx could gain over prompt lookup if verifying more tokens cost less: a model-free bound.

text2sql_bench measures the methods on this machine. This script asks what the same requests
would give on hardware whose forward-pass cost grows more slowly with the number of tokens
verified (a GPU's curve is nearly flat for small trees). It decodes the requests plainly once,
measures this machine's cost curve (specx.bench.calibrate) and the prefill time, then replays the
recorded outputs model-free (core.predict.replay.replay_call with a cost curve) for each method:

- prompt lookup: transformers' rule (the last 2-gram, else 1-gram, at its earliest occurrence;
  the 10 tokens after it), every draft verified whole;
- specx: suffix drafts from the request and the global index, cut by the cost curve as
  `generate` cuts them, for several max-spec factors;
- oracles, the ceiling of any suffix drafter: at every step, of all earlier occurrences of the
  context's last m tokens (in the prompt, the output so far and the earlier outputs) the one
  whose continuation agrees longest with the recorded output, drafted exactly as far as it
  agrees (no wasted draft token), for m = 2 and m = 1;
- specx's own drafts cut perfectly: each draft cut to the path the verifier will accept (what
  sizing would do if it knew which nodes the model accepts).

Each curve is this machine's with its marginal cost scaled by alpha:
cost_alpha(n) = cost(1) + alpha * (cost(n) - cost(1)); alpha 1 is the measured curve (its row
should match text2sql_bench), alpha 0 a pass over 64 tokens that costs what one token costs.
Prefill is counted at its measured time for every method, as in the benchmark.

    .venv/bin/python examples/cost_bound.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from specx.home import specx_home
from specx.bench.calibrate import calibrate
from specx.core.cost.acceptance import AcceptanceModel
from specx.core.cost.forward import ForwardCost
from specx.core.decode.generate import generate
from specx.core.decode.loop import DecodeStats, collect
from specx.core.decode.request import Decoding
from specx.core.decode.speculate import PromptLookupDrafter, SuffixDrafter
from specx.core.draft import Draft, subtree
from specx.core.model.transformers.engine import TransformersEngine
from specx.core.model.load import load_model
from specx.core.predict.replay import replay_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from text2sql_bench import DEFAULT_SPIDER, spider_prompts  # noqa: E402


def scaled(cost: ForwardCost, alpha: float) -> ForwardCost:
    """The curve with its growth over one token scaled by alpha (both context lengths)."""

    def scale(seconds: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return None if seconds is None else tuple(seconds[0] + alpha * (s - seconds[0]) for s in seconds)

    return ForwardCost(cost.sizes, scale(cost.seconds), cost.context, scale(cost.long_seconds), cost.long_context)


class OracleDrafter:
    """A drafter that knows the recorded outputs: the ceiling of suffix drafting (see the docstring).

    Its draft is the agreeing part of the best continuation, so it is accepted whole and verifies
    no token in vain; no drafter built on matches of at least `min_match` tokens (any sizing, any
    tree) takes fewer steps: every path such a drafter proposes is some occurrence's continuation.
    """

    def __init__(self, outputs: list[list[int]], min_match: int) -> None:
        self.outputs = [np.asarray(o, dtype=np.int32) for o in outputs]
        self.min_match = min_match
        self.done = 0  # requests finished: outputs[:done] are the earlier outputs
        self.context = np.zeros(0, dtype=np.int32)
        self.num_prompt = 0

    def start_request(self, prompt) -> None:
        self.context = np.asarray(prompt, dtype=np.int32)
        self.num_prompt = len(self.context)

    def extend(self, tokens) -> None:
        self.context = np.concatenate([self.context, np.asarray(tokens, dtype=np.int32)])

    def finish_request(self, learn: bool = True) -> None:
        self.done += 1

    def speculate(self) -> Draft:
        m, ctx = self.min_match, self.context
        truth = self.outputs[self.done][len(ctx) - self.num_prompt :]
        if len(ctx) < m or len(truth) == 0:
            return Draft()
        best: list[int] = []
        # earlier occurrences with at least one token after them: in the context, any but its own
        # suffix; in an earlier output, any but the one at its very end
        for seq, last in ((ctx, len(ctx) - m), *((o, len(o) - m) for o in self.outputs[: self.done])):
            if last < 1:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seq[: last - 1 + m], m)  # starts 0 .. last - 1
            for end in np.flatnonzero((windows == ctx[-m:]).all(axis=1)) + m:
                cont = seq[end : end + len(truth)]
                agree = int(np.argmin(np.append(cont == truth[: len(cont)], False)))
                if agree > len(best):
                    best = cont[:agree].tolist()
        return Draft(best, list(range(-1, len(best) - 1)), [1.0] * len(best), float(len(best)), m)


class PerfectCut(SuffixDrafter):
    """specx's drafts cut to the path that the recorded output accepts: sizing with hindsight."""

    def __init__(self, outputs: list[list[int]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.outputs = outputs
        self.done = 0

    def finish_request(self, learn: bool = True) -> None:
        super().finish_request(learn)
        self.done += 1

    def speculate(self, context=None) -> Draft:
        draft = super().speculate(context)
        accepted = set(draft.accepted_nodes(self.outputs[self.done][len(self.output) :][: len(draft)]))
        return subtree(draft, [i in accepted for i in range(len(draft))])


def simulate(prompts: list[list[int]], outputs: list[list[int]], prefill: list[float], make_drafter, size: bool,
             cost: ForwardCost, warmup: int) -> dict[str, float]:
    """Replay every request through a fresh drafter; totals over the requests after `warmup`."""
    drafter, acceptance, total = make_drafter(), AcceptanceModel(), DecodeStats()
    seconds = plain = 0.0
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        stats = replay_call(drafter, np.asarray(prompt, dtype=np.int32), np.asarray(output, dtype=np.int32),
                            cost=cost, size=size, acceptance=acceptance)
        if i >= warmup:
            total.add(stats)
            seconds += stats.pass_seconds + prefill[i]
            plain += stats.plain_seconds + prefill[i]
    return {"speedup_vs_plain": plain / seconds, "tokens_per_step": total.tokens / total.steps,
            "drafted_per_step": total.drafted / total.steps, "simulated_tokens_per_s": total.tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="example: .venv/bin/python examples/cost_bound.py --alphas 1,0 --json")
    parser.add_argument("--requests", type=int, default=24, help="requests counted (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=8, help="requests replayed first, not counted")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--alphas", default="1,0.5,0.3,0.2,0.1,0", help="marginal-cost scales to try")
    parser.add_argument("--factors", default="2,4,8", help="specx max-spec factors to try")
    parser.add_argument("--spider", type=Path, default=DEFAULT_SPIDER)
    parser.add_argument("--cache", type=Path, default=specx_home() / "models", help="model cache ($SPECX_HOME/models)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.requests < 1 or args.warmup < 0:
        sys.exit("error: --requests must be at least 1 and --warmup at least 0")
    if not (args.spider / "spider_dev.json").is_file():
        sys.exit(f"error: no spider_dev.json in {args.spider} (pass --spider FOLDER)")
    torch.set_grad_enabled(False)
    net, tok = load_model("smollm2-135m", args.cache)
    prompts = [tok.encode(t, add_special_tokens=False)
               for t in spider_prompts(args.spider, args.warmup + args.requests)]
    cost, engine = calibrate(net), TransformersEngine(net)
    outputs, prefill, prefixes = [], [], engine.new_prefix_cache(8192)
    print(f"decoding {len(prompts)} requests plainly ...", file=sys.stderr)
    for prompt in prompts:
        t0 = time.perf_counter()
        run = collect(generate(engine, prompt, None, Decoding(max_new_tokens=args.max_new_tokens,
                                                              eos_token_ids=tok.eos_token_id), prefix_cache=prefixes))
        totals, tokens = run.stats, run.tokens
        outputs.append(tokens)
        prefill.append(time.perf_counter() - t0 - totals.draft_seconds - totals.verify_seconds)

    factors = [float(f) for f in args.factors.split(",")]
    rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        curve = scaled(cost, alpha)
        row = {"alpha": alpha, "prompt_lookup": simulate(
            prompts, outputs, prefill, lambda: PromptLookupDrafter(max_spec_tokens=10, max_ngram=2), False, curve,
            args.warmup)}
        for f in factors:
            row[f"specx_f{f:g}"] = simulate(prompts, outputs, prefill, lambda: SuffixDrafter(max_spec_factor=f),
                                            True, curve, args.warmup)
        row["specx_perfect_cut"] = simulate(prompts, outputs, prefill,
                                            partial(PerfectCut, outputs, max_spec_factor=max(factors)), False,
                                            curve, args.warmup)
        for m in (2, 1):
            row[f"oracle_m{m}"] = simulate(prompts, outputs, prefill, partial(OracleDrafter, outputs, m), False, curve,
                                           args.warmup)
        best = max((k for k in row if k.startswith("specx_f")), key=lambda k: row[k]["speedup_vs_plain"])
        row["best_specx"] = best
        for k in ("best", "specx_perfect_cut", "oracle_m2", "oracle_m1"):
            row[f"{k}_vs_prompt_lookup"] = (row[best if k == "best" else k]["speedup_vs_plain"]
                                            / row["prompt_lookup"]["speedup_vs_plain"])
        rows.append(row)
    timed = slice(args.warmup, None)
    report = {"rows": rows, "requests": args.requests, "warmup": args.warmup, "max_new_tokens": args.max_new_tokens,
              "prefill_s_mean": float(np.mean(prefill[timed])),
              "curve_ms": {"sizes": list(cost.sizes), "context": cost.context,
                           "seconds": [round(1e3 * s, 2) for s in cost.seconds], "long_context": cost.long_context,
                           "long_seconds": [round(1e3 * s, 2) for s in cost.long_seconds or ()]}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"cost curve (ms at {cost.context} cached tokens): "
          + ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in zip(cost.sizes, cost.seconds)))
    print(f"prefill {report['prefill_s_mean']:.3f} s per request; speedups over plain decoding (simulated):")
    names = ["prompt_lookup", *(f"specx_f{f:g}" for f in factors), "specx_perfect_cut", "oracle_m2", "oracle_m1"]
    print(f"{'alpha':>6}" + "".join(f"{n:>18}" for n in names)
          + "".join(f"{n:>12}" for n in ("best/PL", "cut/PL", "m2/PL", "m1/PL")))
    for row in rows:
        print(f"{row['alpha']:>6g}" + "".join(f"{row[n]['speedup_vs_plain']:>17.2f}x" for n in names)
              + "".join(f"{row[f'{k}_vs_prompt_lookup']:>11.2f}x"
                        for k in ("best", "specx_perfect_cut", "oracle_m2", "oracle_m1")))


if __name__ == "__main__":
    main()
