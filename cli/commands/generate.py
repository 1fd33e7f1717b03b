"""`specx generate`: the model, drafting from the suffix index (registered in app.py; what it runs:
cli/generation.py)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .. import output
from .options import (BackendOpt, ChatTemplateOpt, DbOpt, DrafterOpt, DtypeOpt, JsonOpt, MaxSpecTokensOpt, ModelOpt,
                      check_drafters, option_errors)
from ..home import keep_cost, store_path

PromptArg = Annotated[str, typer.Argument(help="The user message (or raw text with --raw).")]
MaxTokensOpt = Annotated[int, typer.Option(min=1, help="Most tokens to generate.")]
TemperatureOpt = Annotated[float, typer.Option(min=0, help="0 = greedy.")]
TopPOpt = Annotated[float, typer.Option(min=0, max=1, help="Nucleus sampling mass.")]
TopKOpt = Annotated[int, typer.Option(min=0, help="Sample from the k most likely tokens (0 = all).")]
SeedOpt = Annotated[int | None, typer.Option(help="Seed for sampling.")]
StopOpt = Annotated[list[str] | None, typer.Option(help="Stop at this text (repeatable); the output ends "
                                                        "before it.")]
RawOpt = Annotated[bool, typer.Option(help="Use PROMPT as raw text instead of a chat message.")]
JsonSchemaOpt = Annotated[str | None, typer.Option(help="Answer with JSON that matches this schema (a file or "
                                                        "the schema itself; {} for any JSON object), decoded "
                                                        "under its grammar.", show_default=False)]
CompareOpt = Annotated[bool, typer.Option(help="Also decode plainly: speedup, and whether the outputs "
                                               "are identical.")]
RepeatsOpt = Annotated[int, typer.Option(min=1, help="With --compare: runs of each method, taking turns (the "
                                                     "speedup is the median of the pairs; their spread says "
                                                     "whether the machine was steady enough).")]
MaxSpecFactorOpt = Annotated[float, typer.Option(min=0, help="Draft at most factor x match length tokens (4 "
                                                             "suits agents; cost-aware sizing cuts what does "
                                                             "not pay).")]
CostAwareOpt = Annotated[bool, typer.Option("--cost-aware/--fixed-size", help="Learn what a forward pass "
                                            "costs per token verified (from the passes themselves) and cut each "
                                            "draft where expected tokens per second is best (default), or verify "
                                            "whole drafts.")]
VerboseOpt = Annotated[bool, typer.Option(help="Show the forward-pass cost curve learned so far.")]


def generate_cmd(
    prompt: PromptArg,
    model: ModelOpt = "smollm2-135m",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    db: DbOpt = None,
    max_tokens: MaxTokensOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    raw: RawOpt = False,
    chat_template: ChatTemplateOpt = None,
    json_schema: JsonSchemaOpt = None,
    compare: CompareOpt = False,
    repeats: RepeatsOpt = 3,
    max_spec_tokens: MaxSpecTokensOpt = 32,
    max_spec_factor: MaxSpecFactorOpt = 4.0,
    cost_aware: CostAwareOpt = True,
    verbose: VerboseOpt = False,
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
    from ..generation import Generation
    from ..stack import assemble, keep_successors

    check_drafters(drafter_name)
    output.note(f"loading {model} (the first run converts the built-in model, ~30 s) ...")
    # drafting from an empty index needs no store: none is created
    stack = assemble(model, backend=backend, dtype=dtype, say=output.note, chat_template=chat_template,
                     check_template=not raw, db=store_path(db), cost_aware=cost_aware, max_spec_tokens=max_spec_tokens,
                     max_spec_factor=max_spec_factor, drafter=drafter_name)
    cost = stack.cost
    with option_errors():
        generation = Generation(stack, prompt, raw=raw, json_schema=json_schema, max_tokens=max_tokens,
                                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
    result = generation.run(stack.drafter, on_text=None if json_out else _print_text)
    if not json_out:
        output.stdout.out("")
        output.note(f"specx: {result['tokens']} tokens in {result['steps']} steps ({result['tokens_per_s']:.1f} tokens/s,"
                    f" {result['accepted_per_step']:.2f} draft tokens accepted per step;"
                    f" global index {stack.global_index.num_tokens:,} tokens)")
    if compare:
        busy = generation.compare(result, stack.drafter, repeats)
        if not json_out:
            _print_comparison(result, busy)
    if verbose and cost is not None and not json_out:
        _print_cost(stack.engine, cost)
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


def _print_text(text: str) -> None:
    output.stdout.out(text, end="", highlight=False)


def _print_comparison(result: dict[str, Any], busy: str | None) -> None:
    """--compare's line: plain decoding's figures, the speedup of each pair, identical or not."""
    plain, pairs = result["plain"], result["speedups"]
    output.note(f"plain: {plain['tokens']} tokens in {plain['steps']} steps ({plain['tokens_per_s']:.1f} "
                f"tokens/s); speedup {result['speedup']:.2f}x (median of {len(pairs)} pairs, taking turns: "
                f"{', '.join(f'{p:.2f}x' for p in pairs)}); identical output: "
                f"{'yes' if result['identical'] else 'NO'}")
    if busy:
        output.note(busy)


def _print_cost(engine: Any, cost: Any) -> None:
    """--verbose: the engine's kernels and the forward-pass cost curve learned so far."""
    output.note(f"kernels: {', '.join(engine.kernels) or 'none (stock PyTorch)'}")
    curve = cost.snapshot()
    output.print_table(f"forward pass cost (ms) by tokens verified, learned from {cost.passes} passes",
                       ["tokens", f"ms, {curve.context}-token cache", "ms per token",
                        f"ms, {curve.long_context}-token cache"],
                       [[n, 1e3 * t, 1e3 * t / n, 1e3 * lt]
                        for n, t, lt in zip(curve.sizes, curve.seconds, curve.long_seconds)])
