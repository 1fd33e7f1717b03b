"""`specx engines`: which engine runs specx fastest for a model on this machine (the trial:
specx.trial), kept for `--backend auto` (specx.backends)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.model import cpu
from ..core.predict.engines import REFERENCE
from .. import output
from .options import DbOpt, JsonOpt
from ..trial import TRIAL_MAX_TOKENS, TRIAL_REQUESTS, run_trial


def engines_cmd(
    model: Annotated[str, typer.Option(help="Model: built-in name or .gguf file (an HF folder has one engine).",
                                       envvar="SPECX_MODEL")] = "smollm2-135m",
    db: DbOpt = None,
    requests: Annotated[int, typer.Option(min=2, help="Prompts of the trial (the store's latest; the first "
                                                      "untimed).")] = TRIAL_REQUESTS,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per request.")] = TRIAL_MAX_TOKENS,
    json_out: JsonOpt = False,
) -> None:
    """Measure which engine runs specx fastest for this model on this machine, and keep the choice.

    Proves llama.cpp in a child process first (a native crash never takes specx down), then replays
    the store's latest conversations as an agent sends them: consecutive calls of one conversation
    (up to 3 each, the first prompt cut to its last 768 tokens and the later ones from the same
    start, up to 2048), each engine with the prefix cache `specx serve` keeps (llama.cpp reusing
    its last prompt's start), through specx on each engine that can hold the model and through
    llama.cpp's plain decoding, taking turns request by request, whole requests timed (prefill
    included; built-in agent-like prompts when the store has none).
    `--backend auto` in serve, generate and replay uses the choice from then on; `specx serve`
    runs this in the background when no choice was made here.

    Example: [bold]specx engines[/]   (the built-in model: llama.cpp against transformers)
    Example: [bold]specx engines --model path/to/model.gguf --db agents.db --json[/]
    """
    trial = run_trial(model, db, requests, max_tokens, output.note, output.progress)
    choice, figures, kept, data = trial.choice, trial.figures, trial.kept, trial.data
    identical, requests_timed = data["identical_llama_cpp"], data["requests_timed"]
    output.note(choice.line())
    if json_out:
        output.print_json(data)
        if not kept:
            raise typer.Exit(1)
        return
    ref = figures.get(REFERENCE)
    rows = [[name, f.tokens_per_s, f.tokens_per_s / ref.tokens_per_s if ref and ref.tokens_per_s else None,
             f.tokens_per_step, f.decode_tokens_per_s, f.prefill_ms_per_token, f.tokens]
            for name, f in figures.items()]
    output.print_table(f"specx on each engine, {cpu.model_name()} ({' '.join(cpu.instruction_sets())}): "
                       f"{requests_timed} timed requests", ["method", "tokens/s", f"x {REFERENCE}", "tokens/step",
                                                            "decode tokens/s", "prefill ms/token", "tokens"],
                       rows, caption=f"tokens/s: whole requests, prefill included; higher is better. "
                                     f"Chosen: {choice.engine}"
                                     + (f"; specx on llama.cpp identical to llama.cpp plain on {identical}/"
                                        f"{requests_timed}" if identical is not None else ""))
    if not kept:
        raise typer.Exit(1)
