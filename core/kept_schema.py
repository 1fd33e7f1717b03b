"""What a kept file or row must hold, checked by shape and range before anything believes it.

core/kept.py reads a kept file safely as bytes. Bytes that read fine may still hold the wrong
thing (issue 47: `{"choice": "x"}` stopped every start with an AttributeError, a 400-digit
`tokens_per_s` with an OverflowError, a NaN was printed as "specx nan tokens per step"). So each
kind of kept thing has one check, here:

- an engine choice ($SPECX_HOME/engines/choice-*.json): `check_choice`
- a probe verdict ($SPECX_HOME/engines/probe-*.json): `check_verdict`
- a cost curve ($SPECX_HOME/cost/learned-*.json): core/cost/kept_state.check_state, beside the
  curve whose grid it checks against (this module is shared by every tower and imports none)
- a successor table (a row of the store's `successors`): `check_table`, on the arrays' declared
  shapes and dtypes, before anything is allocated

A value that does not fit raises Unusable naming the field (one line); the caller sets the file
aside, or ignores the row, says so in one line, and goes on. Text that comes back from a kept
file passes through `printable` first, so no escape sequence or newline reaches a terminal.

>>> check_choice({"engine": "llama.cpp", "tokens_per_s": {"specx llama.cpp": float("nan")}}, ["llama.cpp"])
Traceback (most recent call last):
...
specx.core.kept.Unusable: holds choice.tokens_per_s.specx llama.cpp = nan, not a number from 0 to 1e+06
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .kept import Unusable

MAX_TOKENS_PER_S = 1e6  # no engine on any machine writes more tokens per second
MAX_TOKENS_PER_STEP = 1024.0  # nor more tokens per step (a draft of 1,023 nodes all accepted)
MAX_VS_REFERENCE = 1e3  # nor runs a thousand times faster than llama.cpp's plain decoding
MAX_METHODS = 16  # methods in one trial (each engine's specx and the reference)
MAX_TEXT = 1000  # characters of a kept reason or message
MAX_NAME = 100  # characters of a kept engine, method or signal name
MAX_TABLE_VOCAB = 1 << 20  # a successor table's tokens (the largest vocabularies have ~262k)
MAX_TABLE_K = 32  # successors per token (specx writes core.index.successors.TABLE_K, 8): room for a later k
TABLE_DTYPES = {"next": "int32", "prob": "float16"}


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """`text` safe for a terminal: characters that are not printable (escape sequences, newlines,
    bidi overrides) written as their Python escapes, and at most `limit` characters.

    >>> printable("ok\\x1b[2J\\nnext")
    'ok\\\\x1b[2J\\\\nnext'
    """
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def check_choice(data: Any, engines: Sequence[str]) -> dict[str, Any]:
    """A kept engine choice (core.predict.engines.Choice's JSON) with every field checked: the
    engine one of `engines`, each figure a finite number in its range, the reason a string (made
    printable); else Unusable naming the field."""
    _object("choice", data)
    engine = data.get("engine")
    if not isinstance(engine, str) or engine not in engines:
        raise Unusable(f"holds choice.engine = {_shown(engine)}, not an engine specx runs ({', '.join(engines)})")
    rates = data.get("tokens_per_s")
    _object("choice.tokens_per_s", rates)
    if not 0 < len(rates) <= MAX_METHODS:
        raise Unusable(f"holds {len(rates)} methods in choice.tokens_per_s, not 1 to {MAX_METHODS}")
    checked = {}
    for method, rate in rates.items():
        name = printable(method, MAX_NAME)
        checked[name] = _figure(f"choice.tokens_per_s.{name}", rate, 0.0, MAX_TOKENS_PER_S)
    vs = data.get("vs_reference")
    reason = data.get("reason", "")
    if not isinstance(reason, str):
        raise Unusable(f"holds choice.reason = {_shown(reason)}, not text")
    figures = data.get("figures") or {}
    _object("choice.figures", figures)
    return {"engine": engine, "tokens_per_s": checked,
            "tokens_per_step": _figure("choice.tokens_per_step", data.get("tokens_per_step", 0.0), 0.0,
                                       MAX_TOKENS_PER_STEP),
            "vs_reference": None if vs is None else _figure("choice.vs_reference", vs, 0.0, MAX_VS_REFERENCE),
            "reason": printable(reason), "figures": figures}


def check_verdict(data: Any) -> dict[str, Any]:
    """A kept probe verdict (core.model.probe.Verdict's JSON) with every field checked: engine,
    message (made printable) and signal text, ok a boolean; else Unusable naming the field."""
    _object("verdict", data)
    for name in ("engine", "message"):
        if not isinstance(data.get(name), str):
            raise Unusable(f"holds verdict.{name} = {_shown(data.get(name))}, not text")
    if not isinstance(data.get("ok"), bool):
        raise Unusable(f"holds verdict.ok = {_shown(data.get('ok'))}, not true or false")
    sig = data.get("signal")
    if sig is not None and not isinstance(sig, str):
        raise Unusable(f"holds verdict.signal = {_shown(sig)}, not a signal's name")
    return {"engine": printable(data["engine"], MAX_NAME), "ok": data["ok"], "message": printable(data["message"]),
            "signal": None if sig is None else printable(sig, MAX_NAME)}


def check_table(arrays: dict[str, tuple[tuple[int, ...], str]], vocab_size: int | None) -> tuple[int, int]:
    """(vocab, k) of a successor table whose arrays declare `arrays` (name -> (shape, dtype name)),
    checked before anything is allocated: `next` int32 and `prob` float16, both of shape vocab x k,
    vocab `vocab_size` (when given; at most MAX_TABLE_VOCAB) and k from 1 to MAX_TABLE_K; else
    Unusable saying what is wrong.

    >>> check_table({"next": ((10, 2), "int32"), "prob": ((10, 2), "float16")}, 10)
    (10, 2)
    >>> check_table({"next": ((10**9, 8), "int32"), "prob": ((10**9, 8), "float16")}, 49152)
    Traceback (most recent call last):
    ...
    specx.core.kept.Unusable: for a vocabulary of 1,000,000,000 tokens, the model has 49,152
    """
    for name, dtype in TABLE_DTYPES.items():
        if name not in arrays:
            raise Unusable(f"damaged: it has no {name} array")
        shape, found = arrays[name]
        if len(shape) != 2 or found != dtype:
            raise Unusable(f"damaged: its {name} array is {found} of shape {shape}, not {dtype} of vocab x k")
    shape = arrays["next"][0]
    if arrays["prob"][0] != shape:
        raise Unusable(f"damaged: its arrays' shapes differ ({shape} and {arrays['prob'][0]})")
    vocab, k = shape
    if vocab_size is not None and vocab != vocab_size:
        raise Unusable(f"for a vocabulary of {vocab:,} tokens, the model has {vocab_size:,}")
    if not 1 <= vocab <= MAX_TABLE_VOCAB:
        raise Unusable(f"damaged: its arrays declare {vocab:,} tokens, not 1 to {MAX_TABLE_VOCAB:,}")
    if not 1 <= k <= MAX_TABLE_K:
        raise Unusable(f"damaged: it keeps {k:,} successors per token, not 1 to {MAX_TABLE_K}")
    return vocab, k


def _object(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise Unusable(f"holds {name} = {_shown(value)}, not an object")


def _figure(name: str, value: Any, low: float, high: float) -> float:
    """`value` as a float when it is a JSON number (not a boolean) from `low` to `high`; else
    Unusable naming `name`. An int of any size is compared as it is (float() of 400 digits would
    raise OverflowError)."""
    number = not isinstance(value, bool) and (isinstance(value, int) or isinstance(value, float) and math.isfinite(value))
    if not number or not low <= value <= high:
        raise Unusable(f"holds {name} = {_shown(value)}, not a number from {low:g} to {high:g}")
    return float(value)


def _shown(value: Any) -> str:
    """A kept value as a short printable phrase (never the whole of a large one)."""
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return printable(repr(value), 60)
