"""`specx generate`: the model, drafting from the suffix index (registered in app.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import output
from .options import BackendOpt, DbOpt, DrafterOpt, DtypeOpt, JsonOpt, ModelOpt, check_drafters
from ..home import keep_cost, store_path


def generate_cmd(
    prompt: Annotated[str, typer.Argument(help="The user message (or raw text with --raw).")],
    model: ModelOpt = "smollm2-135m",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    db: DbOpt = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0, max=1, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="Sample from the k most likely tokens (0 = all).")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable); the output ends "
                                                         "before it.")] = None,
    raw: Annotated[bool, typer.Option(help="Use PROMPT as raw text instead of a chat message.")] = False,
    chat_template: Annotated[str | None, typer.Option(help="Chat template (Jinja) for the model, or a file "
                                                         "holding one (default: the model's own).",
                                                         show_default=False)] = None,
    json_schema: Annotated[str | None, typer.Option(help="Answer with JSON that matches this schema (a file or "
                                                         "the schema itself; {} for any JSON object), decoded "
                                                         "under its grammar.", show_default=False)] = None,
    compare: Annotated[bool, typer.Option(help="Also decode plainly: speedup, and whether the outputs "
                                               "are identical.")] = False,
    repeats: Annotated[int, typer.Option(min=1, help="With --compare: runs of each method, taking turns (the "
                                                     "speedup is the median of the pairs; their spread says "
                                                     "whether the machine was steady enough).")] = 3,
    max_spec_tokens: Annotated[int, typer.Option(min=0, help="Most draft tokens per step.")] = 32,
    max_spec_factor: Annotated[float, typer.Option(min=0, help="Draft at most factor x match length tokens (4 "
                                                              "suits agents; cost-aware sizing cuts what does "
                                                              "not pay).")] = 4.0,
    cost_aware: Annotated[bool, typer.Option("--cost-aware/--fixed-size", help="Learn what a forward pass "
                                             "costs per token verified (from the passes themselves) and cut each "
                                             "draft where expected tokens per second is best (default), or verify "
                                             "whole drafts.")] = True,
    verbose: Annotated[bool, typer.Option(help="Show the forward-pass cost curve learned so far.")] = False,
    drafter_name: DrafterOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Generate text with the model, drafting from the suffix index (lossless speculative decoding).

    The global index holds the outputs in the store (`specx ingest`) for this model's tokenizer,
    when there are any; the request index holds the prompt and the output so far. Text streams to
    stdout; statistics go to stderr (or all into one object with --json).

    Example: [bold]specx generate "List the tables of a SQL database about singers." --compare[/]
    Example: [bold]specx generate "SELECT name FROM" --raw --stop ";" --max-tokens 32[/]
    Example: [bold]specx generate "Why is the sky blue?" --drafter hybrid --compare[/]
    Example: [bold]specx generate "A cat as JSON." --json-schema '{"type": "object", "properties": {"name": {"type": "string"}}}'[/]
    """
    import statistics
    import time

    from ..core.decode.generate import generate
    from ..core.decode.grammar import GrammarError, Vocabulary
    from ..core.decode.loop import collect
    from ..core.decode.request import Decoding
    from ..core.decode.hybrid import HybridDrafter
    from ..core.decode.speculate import SuffixDrafter
    from ..core.decode.text import TextStream
    from ..core.model.chat import chat_tokens
    from ..core.predict.compare import busy_note, steady

    from ..stack import assemble, keep_successors

    check_drafters(drafter_name)
    output.note(f"loading {model} (the first run converts the built-in model, ~30 s) ...")
    # drafting from an empty index needs no store: none is created
    stack = assemble(model, backend=backend, dtype=dtype, say=output.note, chat_template=chat_template,
                     check_template=not raw, db=store_path(db), cost_aware=cost_aware, max_spec_tokens=max_spec_tokens,
                     max_spec_factor=max_spec_factor, drafter=drafter_name)
    engine, tok, cost = stack.engine, stack.tokenizer, stack.cost
    if raw:
        prompt_ids = tok.encode(prompt, add_special_tokens=False)
    else:
        prompt_ids = chat_tokens(tok, [{"role": "user", "content": prompt}])
    eos = tok.eos_token_id
    grammar = vocabulary = None
    if json_schema is not None:
        grammar, vocabulary = _schema_grammar(json_schema), Vocabulary(tok, engine.vocab_size, eos)
        try:
            vocabulary.check(grammar)
        except GrammarError as exc:
            raise typer.BadParameter(str(exc), param_hint="--json-schema") from None
    settings = Decoding(max_new_tokens=max_tokens, eos_token_ids=eos, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, stop=stop, grammar=grammar)

    def run(drafter: SuffixDrafter | HybridDrafter | None, stream: bool) -> dict:
        text = TextStream(tok, stop=settings.stop)
        t0 = time.perf_counter()
        run = collect(generate(engine, prompt_ids, drafter, settings, stop=text,
                               constraint=settings.constraint(vocabulary), cost=cost if drafter is not None else None,
                               threads=stack.threads, learn=False,
                               successors=stack.successors if drafter is not None else None),
                      (lambda step, so_far: output.stdout.out(text.pop(), end="", highlight=False)) if stream else None)
        assert run is not None
        totals, tokens = run.stats, run.tokens
        if stream:
            output.stdout.out(text.pop(final=True), end="", highlight=False)
        seconds = time.perf_counter() - t0
        return {"text": text.text, "finish_reason": text.finish_reason(max_tokens, settings.eos_token_ids),
                "tokens": len(tokens), "steps": totals.steps, "accepted_per_step": totals.accepted_per_step,
                "drafted": totals.drafted, "seconds": seconds,
                "tokens_per_s": len(tokens) / seconds if seconds else 0.0, "token_ids": tokens}

    drafter = stack.drafter
    result = run(drafter, stream=not json_out)
    if not json_out:
        output.stdout.out("")
        output.note(f"specx: {result['tokens']} tokens in {result['steps']} steps ({result['tokens_per_s']:.1f} tokens/s,"
                    f" {result['accepted_per_step']:.2f} draft tokens accepted per step;"
                    f" global index {stack.global_index.num_tokens:,} tokens)")
    if compare:
        # the methods take turns, so that a machine that slows down weighs on both alike
        runs = {"specx": [result], "plain": []}
        for i in range(repeats):
            runs["plain"].append(run(None, stream=False))
            if i + 1 < repeats:
                runs["specx"].append(run(drafter, stream=False))
        plain = runs["plain"][0]
        pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["specx"], runs["plain"]) if b["tokens_per_s"]]
        rates = [r["tokens_per_s"] for r in runs["plain"]]
        result["plain"] = {k: v for k, v in plain.items() if k not in ("text", "token_ids")}
        result["plain"]["tokens_per_s"] = statistics.median(rates)
        result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs["specx"])
        result["speedup"] = statistics.median(pairs) if pairs else None
        result["speedups"] = pairs
        result["identical"] = all(r["token_ids"] == plain["token_ids"] for r in runs["specx"] + runs["plain"])
        result["steady"] = steady(rates)
        if not json_out:
            output.note(f"plain: {plain['tokens']} tokens in {plain['steps']} steps ({result['plain']['tokens_per_s']:.1f} "
                        f"tokens/s); speedup {result['speedup']:.2f}x (median of {len(pairs)} pairs, taking turns: "
                        f"{', '.join(f'{p:.2f}x' for p in pairs)}); identical output: "
                        f"{'yes' if result['identical'] else 'NO'}")
            busy = busy_note("plain decoding", rates)
            if busy:
                output.note(busy)
    if verbose and cost is not None and not json_out:
        output.note(f"kernels: {', '.join(engine.kernels) or 'none (stock PyTorch)'}")
        curve = cost.snapshot()
        output.print_table(f"forward pass cost (ms) by tokens verified, learned from {cost.passes} passes",
                           ["tokens", f"ms, {curve.context}-token cache", "ms per token",
                            f"ms, {curve.long_context}-token cache"],
                           [[n, 1e3 * t, 1e3 * t / n, 1e3 * lt]
                            for n, t, lt in zip(curve.sizes, curve.seconds, curve.long_seconds)])
    if cost is not None:
        keep_cost(cost, output.note)
    keep_successors(stack, store_path(db), output.note)
    if json_out:
        result.pop("token_ids")
        if cost is not None:
            curve = cost.snapshot()
            result["cost_curve"] = {"tokens": list(curve.sizes), "seconds": list(curve.seconds),
                                    "context": curve.context, "long_seconds": list(curve.long_seconds or []),
                                    "long_context": curve.long_context, "passes": cost.passes}
        output.print_json(result)


def _schema_grammar(value: str) -> str:
    """--json-schema: a file holding a JSON schema, or the schema itself, as a grammar."""
    import json
    from pathlib import Path

    from ..core.decode.grammar import json_schema_grammar

    path = Path(value).expanduser()
    try:
        text = path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value
        schema = json.loads(text)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"neither a JSON schema nor a file holding one: {exc}",
                                 param_hint="--json-schema") from None
    if not isinstance(schema, dict):
        raise typer.BadParameter("a JSON schema is an object", param_hint="--json-schema")
    return json_schema_grammar(schema)
