"""What `specx generate` runs: one prompt decoded on a stack (stack.py's), drafted or plainly, its
text streamed as it comes; with --compare, plain decoding and the drafted taking turns. The command
(commands/generate.py) parses and prints; an option found wrong here is a SettingError naming it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .stack import SettingError

if TYPE_CHECKING:
    from .core.decode.hybrid import HybridDrafter
    from .core.decode.speculate import SuffixDrafter
    from .core.decode.stack import Stack


class Generation:
    """`prompt` on `stack`: a chat message (`raw`: text as it is) decoded with the sampling settings
    (core.decode.request.Decoding's), under `json_schema`'s grammar when given (a file holding a
    JSON schema, or the schema itself); SettingError (--json-schema) for a schema that is none or
    that the model's vocabulary cannot write."""

    def __init__(self, stack: Stack, prompt: str, *, raw: bool, json_schema: str | None, max_tokens: int,
                 temperature: float, top_p: float, top_k: int, seed: int | None, stop: list[str] | None) -> None:
        from .core.decode.grammar import GrammarError, Vocabulary
        from .core.decode.request import Decoding
        from .core.model.chat import chat_tokens

        self.stack = stack
        tok = stack.tokenizer
        if raw:
            self.prompt_ids = tok.encode(prompt, add_special_tokens=False)
        else:
            self.prompt_ids = chat_tokens(tok, [{"role": "user", "content": prompt}])
        eos = tok.eos_token_id
        grammar = self.vocabulary = None
        if json_schema is not None:
            grammar, self.vocabulary = schema_grammar(json_schema), Vocabulary(tok, stack.engine.vocab_size, eos)
            try:
                self.vocabulary.check(grammar)
            except GrammarError as exc:
                raise SettingError("--json-schema", str(exc)) from None
        self.settings = Decoding(max_new_tokens=max_tokens, eos_token_ids=eos, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=seed, stop=stop, grammar=grammar)

    def run(self, drafter: SuffixDrafter | HybridDrafter | None,
            on_text: Callable[[str], None] | None = None) -> dict[str, Any]:
        """One decoding with `drafter` (None: plain decoding), `on_text` hearing the text as it comes:
        the text, why it finished, tokens, steps, draft tokens accepted per step, seconds, tokens/s."""
        from .core.decode.generate import generate
        from .core.decode.loop import collect
        from .core.decode.text import TextStream

        stack, settings = self.stack, self.settings
        text = TextStream(stack.tokenizer, stop=settings.stop)
        t0 = time.perf_counter()
        run = collect(generate(stack.engine, self.prompt_ids, drafter, settings, stop=text,
                               constraint=settings.constraint(self.vocabulary),
                               cost=stack.cost if drafter is not None else None, learn=False,
                               successors=stack.successors if drafter is not None else None),
                      (lambda step, so_far: on_text(text.pop())) if on_text is not None else None)
        assert run is not None
        totals, tokens = run.stats, run.tokens
        if on_text is not None:
            on_text(text.pop(final=True))
        seconds = time.perf_counter() - t0
        finish_reason = text.finish_reason(settings.max_new_tokens, settings.eos_token_ids)
        return {"text": text.text, "finish_reason": finish_reason,
                "tokens": len(tokens), "steps": totals.steps, "accepted_per_step": totals.accepted_per_step,
                "drafted": totals.drafted, "seconds": seconds,
                "tokens_per_s": len(tokens) / seconds if seconds else 0.0, "token_ids": tokens}

    def compare(self, result: dict[str, Any], drafter: SuffixDrafter | HybridDrafter | None,
                repeats: int) -> str | None:
        """Add plain decoding to `result` (run's, with `drafter`): `repeats` runs of each, taking turns
        (so that a machine that slows down weighs on both alike), `result` the first drafted one; the
        speedup is the median of the pairs, the tokens/s the medians. Returns core.predict.compare's
        note when the plain runs' speeds say the machine was not steady (else None)."""
        from .core.predict.compare import busy_note, steady

        runs = {"specx": [result], "plain": []}
        for i in range(repeats):
            runs["plain"].append(self.run(None))
            if i + 1 < repeats:
                runs["specx"].append(self.run(drafter))
        plain = runs["plain"][0]
        pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["specx"], runs["plain"])
                 if b["tokens_per_s"]]
        rates = [r["tokens_per_s"] for r in runs["plain"]]
        result["plain"] = {k: v for k, v in plain.items() if k not in ("text", "token_ids")}
        result["plain"]["tokens_per_s"] = statistics.median(rates)
        result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs["specx"])
        result["speedup"] = statistics.median(pairs) if pairs else None
        result["speedups"] = pairs
        result["identical"] = all(r["token_ids"] == plain["token_ids"] for r in runs["specx"] + runs["plain"])
        result["steady"] = steady(rates)
        return busy_note("plain decoding", rates)


def schema_grammar(value: str) -> str:
    """--json-schema: a file holding a JSON schema, or the schema itself, as a grammar."""
    import json
    from pathlib import Path

    from .core.decode.grammar import json_schema_grammar

    path = Path(value).expanduser()
    try:
        text = path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value
        schema = json.loads(text)
    except (OSError, ValueError) as exc:
        raise SettingError("--json-schema", f"neither a JSON schema nor a file holding one: {exc}") from None
    if not isinstance(schema, dict):
        raise SettingError("--json-schema", "a JSON schema is an object")
    return json_schema_grammar(schema)
