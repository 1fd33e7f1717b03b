"""Which engine runs specx fastest here: a trial of specx itself on each engine, side by side.

What specx gains depends on the engine's cost curve on this CPU (on AVX-512 a transformers pass
over 8 tokens costs ~1.2x one token, llama.cpp's ~5x; on AVX2 llama.cpp's one-token pass is the
cheaper by far) and on the workload's tokens per step (what the store's outputs let it draft). No
rule gets both right, so the choice is measured: the same prompts (the workload's own, from the
store) go through specx on every engine that can hold the model, and through llama.cpp's plain
decoding as the reference, the methods taking turns request by request, so a machine whose load
changes weighs on all alike. Whole requests are timed, prefill included: agents' prompts are long,
and an engine that decodes fast but prefills slowly loses there.

    figures = trial({"llama.cpp": run_a, "transformers": run_b}, prompts)
    choice = choose(figures)             # Choice("transformers", ...): the most tokens per second
    choice.line()                        # "engine: transformers, specx 2.9 tokens per step, ..."
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

REFERENCE = "llama.cpp plain"  # what the figures are compared with (the engine local users run)


@dataclass
class Request:
    """One request's measurement: tokens out, steps, the prefill (the first step, which also
    writes the first token) and the rest."""

    tokens: list[int]
    steps: int
    prefill_seconds: float
    decode_seconds: float
    first_tokens: int = 1  # the tokens the first step wrote


@dataclass
class Figures:
    """One method's totals over the timed requests."""

    method: str
    prompt_tokens: int = 0
    tokens: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    first_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, prompt_tokens: int, request: Request) -> None:
        self.prompt_tokens += prompt_tokens
        self.tokens += len(request.tokens)
        self.steps += request.steps
        self.prefill_seconds += request.prefill_seconds
        self.decode_seconds += request.decode_seconds
        self.first_tokens += request.first_tokens

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of whole requests (prefill included): what a client sees."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first (the decoding alone)."""
        return (self.tokens - self.first_tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def prefill_ms_per_token(self) -> float:
        return 1e3 * self.prefill_seconds / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "tokens_per_s": round(self.tokens_per_s, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "tokens_per_step": round(self.tokens_per_step, 3),
                "prefill_ms_per_token": round(self.prefill_ms_per_token, 3), "tokens": self.tokens,
                "steps": self.steps, "prompt_tokens": self.prompt_tokens, "seconds": round(self.seconds, 3)}


Runner = Callable[[list[int]], Request]


def timed(steps: Any, collect: Callable[..., Any]) -> Request:
    """Run a decode (core.decode.generate's steps) through `collect`, timing its first step apart."""
    t0 = time.perf_counter()
    first: list[tuple[float, int]] = []

    def on_step(step: Any, so_far: Any) -> None:
        if not first:
            first.append((time.perf_counter(), len(so_far.tokens)))

    run = collect(steps, on_step)
    end = time.perf_counter()
    t1, num_first = first[0] if first else (end, 0)
    return Request(list(run.tokens), run.stats.steps, t1 - t0, end - t1, num_first)


def trial(runners: dict[str, Runner], prompts: Sequence[Sequence[int]], warmup: int = 1,
          on_request: Callable[[], None] = lambda: None) -> dict[str, Figures]:
    """Every method in `runners` on every prompt, taking turns (the order rotates from prompt to
    prompt, so no method always runs first); the first `warmup` prompts untimed."""
    figures = {name: Figures(name) for name in runners}
    names = list(runners)
    for i, prompt in enumerate(prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            request = runners[name](list(prompt))
            on_request()
            if i >= warmup:
                figures[name].add(len(prompt), request)
                figures[name].outputs.append(request.tokens)
    return figures


@dataclass
class Choice:
    """The engine specx runs fastest on, and the figures that say so (JSON-ready)."""

    engine: str
    tokens_per_s: dict[str, float]  # method -> whole-request tokens per second
    tokens_per_step: float  # specx's on the chosen engine
    vs_reference: float | None  # the chosen engine's specx against llama.cpp plain
    reason: str
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)

    def line(self) -> str:
        ref = f", est. {self.vs_reference:.2f}x {REFERENCE} decoding here" if self.vs_reference else ""
        return f"engine: {self.engine}, specx {self.tokens_per_step:.1f} tokens per step{ref} ({self.reason})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, engines: Sequence[str]) -> Choice:
        """A kept choice, every field checked by shape and range (core.kept_schema.check_choice: the
        engine one of `engines`, finite figures, a printable reason); else core.kept.Unusable (a
        ValueError) naming the field."""
        from ..kept_schema import check_choice

        return cls(**check_choice(data, engines))


def specx_method(engine: str) -> str:
    return f"specx {engine}"


def choose(figures: dict[str, Figures], engines: Sequence[str]) -> Choice:
    """The engine of `engines` whose specx served the trial's requests at the most tokens per
    second (prefill included).

    >>> f = {"specx llama.cpp": Figures("specx llama.cpp", 100, 60, 50, 0.2, 0.8, 2),
    ...      "specx transformers": Figures("specx transformers", 100, 60, 20, 0.1, 0.6, 2),
    ...      "llama.cpp plain": Figures("llama.cpp plain", 100, 60, 60, 0.2, 1.0, 2)}
    >>> c = choose(f, ["llama.cpp", "transformers"])
    >>> c.engine, round(c.vs_reference, 2), c.tokens_per_step
    ('transformers', 1.71, 3.0)
    """
    rates = {name: fig.tokens_per_s for name, fig in figures.items()}
    candidates = [e for e in engines if rates.get(specx_method(e), 0.0) > 0]
    if not candidates:
        raise ValueError("no engine decoded a timed request")
    best = max(candidates, key=lambda e: rates[specx_method(e)])
    ref = rates.get(REFERENCE) or None
    others = [f"{rates[specx_method(e)]:.1f} on {e}" for e in candidates if e != best]
    reason = (f"specx {rates[specx_method(best)]:.1f} tokens/s on {best}"
              + (f" against {', '.join(others)}" if others else ", the only engine that runs here")
              + f", {sum(f.tokens for f in figures.values() if f.method == specx_method(best))} tokens measured")
    return Choice(best, {k: round(v, 2) for k, v in rates.items()},
                  round(figures[specx_method(best)].tokens_per_step, 3),
                  round(rates[specx_method(best)] / ref, 3) if ref else None, reason,
                  {name: fig.to_json() for name, fig in figures.items()})
