"""The projections' cost curves: the relative cost of one verification pass over k tokens
(`CostCurve`, cost(1) = 1), from a file (`load_cost_curve`: what `specx bench cost` writes, or
k -> cost by hand) or built in (`builtin_curves`: a GPU's flat curve, the shipped CPU one).
core/predict/estimate.py projects speedups on them."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cost.forward import FixedCost, ForwardCost
from ..cost.shipped import shipped_curves

FLAT_UPTO = 64  # the shipped flat curve: 1.0 for every k up to this


class PredictError(ValueError):
    """Bad input to the predictor (a cost curve file, a sample size): the message names the file or field."""


@dataclass(frozen=True)
class CostCurve(FixedCost):
    """Relative cost of one verification pass over k tokens (cost(1) = 1): a ForwardCost of one
    curve, interpolated linearly, and linearly extrapolated past the last point from the last two
    (a single point: the same cost for every k). Calls are memoised (sizing asks often). A fixed
    curve: it caps no draft and learns nothing from the replay's steps (core.cost.forward.FixedCost).

    >>> curve = CostCurve.from_mapping("c", {"1": 2.0, "3": 3.0, "5": 5.0})  # normalised by cost(1)
    >>> [curve(k) for k in (1, 2, 3, 4, 5, 7)]
    [1.0, 1.25, 1.5, 2.0, 2.5, 3.5]
    """

    name: str
    cost: ForwardCost
    about: str = ""
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, n: int, context: int | None = None) -> float:
        """The pass over `n` tokens (`context` is taken, as ForwardCost takes it, and ignored: a
        relative curve has one context length)."""
        value = self._memo.get(n)
        if value is None:
            value = self._memo[n] = self.cost(n)
        return value

    def flat(self, upto: int) -> bool:
        """The same cost for every k from 1 to `upto`: no draft node costs anything there."""
        return all(self(k) == self(1) for k in range(1, upto + 1))

    def points(self) -> dict[str, float]:
        return {str(k): s for k, s in zip(self.cost.sizes, self.cost.seconds)}

    @classmethod
    def from_mapping(cls, name: str, mapping: Any, about: str = "", where: str | None = None) -> CostCurve:
        """From {"1": 1.0, "2": 1.02, ...} (k -> cost of verifying k tokens, any unit: the curve is
        divided by its cost at 1); `where` names the source in errors (default: `name`)."""
        where = where or name
        if not isinstance(mapping, Mapping) or not mapping:
            raise PredictError(f"cost curve {where}: expected a JSON object of token counts to costs, "
                               f'such as {{"1": 1.0, "8": 1.3}}')
        points: dict[int, float] = {}
        for key, value in mapping.items():
            try:
                k = int(str(key).strip())
            except ValueError:
                k = 0
            if k < 1 or str(k) != str(key).strip():
                raise PredictError(f"cost curve {where}: key {key!r} is not a number of tokens (an integer >= 1)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise PredictError(f"cost curve {where}: {key!r} must be a positive number, got {value!r}")
            if k in points:
                raise PredictError(f"cost curve {where}: {key!r} is given twice")
            points[k] = float(value)
        if 1 not in points:
            raise PredictError(f'cost curve {where}: needs "1", the cost of verifying one token (plain decoding)')
        sizes = sorted(points)
        base = points[1]
        return cls(name, ForwardCost(tuple(sizes), tuple(points[k] / base for k in sizes)), about)


def load_cost_curve(path: str | Path, name: str | None = None) -> CostCurve:
    """A curve file: {"1": 1.0, "2": 1.02, ...}, or {"cost": {...}, "about": "where it comes from"}."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PredictError(f"cost curve {path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise PredictError(f"cost curve {path}: not a text file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PredictError(f"cost curve {path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    about = ""
    if isinstance(data, dict) and "cost" in data:
        about = data.get("about", "")
        if not isinstance(about, str):
            raise PredictError(f'cost curve {path}: "about" must be a string')
        extra = set(data) - {"cost", "about", "engine", "roofline"}  # the last two: `specx bench cost`'s notes
        if extra:
            raise PredictError(f'cost curve {path}: unknown field {sorted(extra)[0]!r} (expected "cost" and "about")')
        data = data["cost"]
    return CostCurve.from_mapping(name or path.stem, data, about, where=str(path))


def builtin_curves() -> dict[str, CostCurve]:
    """The projections' built-in curves: "flat" (a large model on a GPU at small batch: verifying up
    to 64 tokens costs what one does) and "cpu" (the built-in model on the 2-core development CPU,
    the curve shipped in core.cost.shipped, measured with `specx bench cost`; its file says where it
    comes from)."""
    flat = CostCurve.from_mapping("flat", {"1": 1.0, str(FLAT_UPTO): 1.0},
                                  f"a large model on a GPU at small batch: 1.0 for every k up to {FLAT_UPTO}")
    cpu = shipped_curves()["cpu"]
    return {"flat": flat, "cpu": CostCurve("cpu", cpu.cost, cpu.about)}
