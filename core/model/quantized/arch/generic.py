"""Plain LLVM vector IR with vpdpbusd's arithmetic (widen to int16, multiply, add pairs, then pairs
of pairs): whatever the CPU, LLVM picks its instructions. The reference the others agree with."""

from __future__ import annotations

from typing import Any

from llvmlite import ir

from ..ir import I8, I16, I32
from ..quant import Format

NAME = "generic vectors"
LANES = 16
PRIORITY = 0  # the last resort: any CPU, and any CPU name no other family lists
REQUIRES: frozenset[str] = frozenset()
CPUS: dict[str, frozenset[str]] = {}


class Dots:
    offset_done = False

    def __init__(self, builder: ir.IRBuilder, fmt: Format, lanes: int = LANES) -> None:
        self.b, self.lanes = builder, lanes

    def prepare(self, weights: list[Any]) -> list[Any]:
        return weights

    def dot(self, weights: list[Any], xs: list[Any]) -> Any:
        acc = ir.Constant(ir.VectorType(I32, self.lanes), None)
        for w, x in zip(weights, xs):
            acc = self._dot4(acc, w, x)
        return acc

    def _dot4(self, acc: Any, w: Any, x: Any) -> Any:
        """acc[i] + sum_j<4 u8(w)[4i + j] * s8(x)[4i + j]: products fit int16, pairs are summed as
        pmaddwd does, then pairs of pairs."""
        b, lanes = self.b, self.lanes
        vi8, vi16, vpairs = (ir.VectorType(I8, 4 * lanes), ir.VectorType(I16, 4 * lanes), ir.VectorType(I32, 2 * lanes))
        u = b.zext(b.bitcast(w, vi8), vi16)
        s = b.sext(b.bitcast(x, vi8), vi16)
        undef = ir.Constant(vi16, ir.Undefined)
        pick = lambda v, start: b.shuffle_vector(  # noqa: E731
            v, undef, ir.Constant(ir.VectorType(I32, 2 * lanes), list(range(start, 4 * lanes, 2))))
        pairs = b.add(b.mul(b.sext(pick(u, 0), vpairs), b.sext(pick(s, 0), vpairs)),
                      b.mul(b.sext(pick(u, 1), vpairs), b.sext(pick(s, 1), vpairs)))
        undef32 = ir.Constant(vpairs, ir.Undefined)
        even = b.shuffle_vector(pairs, undef32, ir.Constant(ir.VectorType(I32, lanes), list(range(0, 2 * lanes, 2))))
        odd = b.shuffle_vector(pairs, undef32, ir.Constant(ir.VectorType(I32, lanes), list(range(1, 2 * lanes, 2))))
        return b.add(acc, b.add(even, odd))
