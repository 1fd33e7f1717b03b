"""The forward-pass cost curves shipped with specx (curves/*.json), by name.

Each file holds milliseconds of one verification pass over k tokens and where they come from:
{"about": "...", "cost": {"1": 31.36, "2": 32.089, ...}} ("cpu": the built-in model on the 2-core
development CPU, `specx bench cost`; "llamacpp": its GGUF on llama.cpp, docs/llamacpp.md;
"quantized-<family>": its GGUF on the quantized engine per instruction-set family). They
serve as the prior shape of a learned cost (core.cost.learned) and as the projections' curves
(core.predict.estimate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .forward import ForwardCost

FOLDER = Path(__file__).resolve().parent / "curves"  # package data (pyproject.toml)


@dataclass(frozen=True)
class ShippedCurve:
    """A shipped curve: `cost` relative to one token (cost(1) = 1), `about` where it comes from."""

    name: str
    cost: ForwardCost
    about: str


def shipped_curves() -> dict[str, ShippedCurve]:
    """Every shipped curve by name (its file's stem), read from the package's files.

    >>> sorted(shipped_curves()), shipped_curves()["cpu"].cost(1)
    (['cpu', 'llamacpp', 'quantized-avx2', 'quantized-avx512vnni', 'quantized-avxvnni'], 1.0)
    """
    curves = {}
    for path in sorted(FOLDER.glob("*.json")):
        doc = json.loads(path.read_text())
        points = {int(k): float(v) for k, v in doc["cost"].items()}
        sizes = sorted(points)
        cost = ForwardCost(tuple(sizes), tuple(points[k] / points[1] for k in sizes))
        curves[path.stem] = ShippedCurve(path.stem, cost, doc.get("about", ""))
    return curves
