"""What the quantized engine's ways of keeping the cache cost in quality (int8 keys, bfloat16 values),
against float16 keys and values, on real agent logs: the same model, the same text, teacher-forced,
in one process.

    python examples/kv_keys_quality.py ../shared/agent-data/swe-agent-multi-swe-bench-java/trajs --tokens 6000
    python examples/kv_keys_quality.py some.traj --tokens 6000 --texts 3 --formats f16/f16,q8/bf16 --json out.json

Each text (a file's first `--tokens` tokens of its raw text; folders are walked, files taken in
sorted order, one text a file) runs through the engine once per format (`--formats` KEYS/VALUES,
the first the reference), with the logits of every position kept: per format the mean negative
log-likelihood of the text's next tokens (its perplexity), and against the reference the share of
positions whose top-1 token agrees, the mean and 99th percentile of KL(reference || format), by
where in the context the position lies. Prints a table (stderr: progress) and, with --json, writes
every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def texts(paths: list[str], count: int) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return files[:count]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def all_logits(engine, ids: list[int]) -> np.ndarray:  # noqa: ANN001 - a QuantEngine
    """Logits [N, V] at every position of `ids`, prefilled 64 at a time as the engine does."""
    from specx.core.model.quantized.engine import KVCache
    from specx.core.model.sessions import prefill_parts

    kv, out = KVCache(engine.model.config, len(ids) + 16), []
    for kv_, chunk, positions, allowed, _ in prefill_parts(kv, ids):
        out.append(engine.model.forward(kv_, chunk, positions, allowed, np.arange(len(chunk))))
    return np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="text files or folders of them (agent logs)")
    parser.add_argument("--tokens", type=int, default=6000, help="tokens of each text")
    parser.add_argument("--texts", type=int, default=3, help="texts at most")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the built-in model's)")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--formats", default="f16/f16,q8/f16,q8/bf16",
                        help="KEYS/VALUES formats, comma-separated, the first the reference (default: %(default)s)")
    args = parser.parse_args()

    from specx.core.model import cpu
    from specx.core.model.load import builtin_gguf, load_tokenizer
    from specx.core.model.quantized.engine import QuantEngine

    path = args.model or builtin_gguf("smollm2-135m")
    tokenizer = load_tokenizer()
    formats = args.formats.split(",")
    if len(formats) < 2 or any(len(f.split("/")) != 2 for f in formats):
        parser.error(f"--formats {args.formats!r}: two KEYS/VALUES pairs or more, e.g. f16/f16,q8/bf16")
    engines = {f: QuantEngine(path, context=args.tokens + 64, keys=f.split("/")[0], values=f.split("/")[1])
               for f in formats}
    ref = formats[0]
    bands = [(0, 1000), (1000, 3000), (3000, 6000), (6000, 24000)]
    result: dict = {"model": str(path), "cpu": cpu.model_name(), "tokens": args.tokens, "reference": ref,
                    "texts": []}
    for f in texts(args.paths, args.texts):
        ids = tokenizer(f.read_text(errors="replace"))["input_ids"][: args.tokens]
        if len(ids) < 100:
            print(f"{f}: {len(ids)} tokens, skipped", file=sys.stderr)
            continue
        print(f"{f.name}: {len(ids)} tokens", file=sys.stderr)
        logp = {k: log_softmax(all_logits(e, ids)[:-1]) for k, e in engines.items()}
        nxt = np.asarray(ids[1:])
        nll = {k: -lp[np.arange(len(nxt)), nxt] for k, lp in logp.items()}
        row = {"file": str(f), "tokens": len(ids),
               "perplexity": {k: round(float(np.exp(v.mean())), 4) for k, v in nll.items()}, "against": {}}
        for k in formats[1:]:
            agree = logp[ref].argmax(1) == logp[k].argmax(1)
            kl = (np.exp(logp[ref]) * (logp[ref] - logp[k])).sum(1)
            row["against"][k] = {"top1_agree": round(float(agree.mean()), 4), "kl_mean": float(kl.mean()),
                                 "kl_p99": float(np.percentile(kl, 99)), "by_position": {}}
            for lo, hi in bands:
                if lo < len(nxt):
                    sl = slice(lo, min(hi, len(nxt)))
                    row["against"][k]["by_position"][f"{lo}-{hi}"] = {
                        "top1_agree": round(float(agree[sl].mean()), 4), "kl_mean": float(kl[sl].mean()),
                        "nll": float(nll[k][sl].mean()), "nll_reference": float(nll[ref][sl].mean())}
        result["texts"].append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"keys/values formats against {ref}, {Path(result['model']).name}, teacher-forced, {result['cpu']}")
    print(f"{'text':<34} {'tokens':>6} {'format':>8} {'ppl':>8} {'ppl ref':>8} {'top-1 same':>10} {'KL mean':>9} "
          f"{'KL p99':>8}")
    for r in result["texts"]:
        for k, a in r["against"].items():
            print(f"{Path(r['file']).name[:34]:<34} {r['tokens']:>6} {k:>8} {r['perplexity'][k]:>8.3f} "
                  f"{r['perplexity'][ref]:>8.3f} {a['top1_agree']:>10.4f} {a['kl_mean']:>9.5f} {a['kl_p99']:>8.4f}")


if __name__ == "__main__":
    main()
