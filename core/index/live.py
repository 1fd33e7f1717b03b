"""Live sequences (the request index: prompt plus output so far) as regions of flat arenas."""

from __future__ import annotations

import numpy as np

from .prefix_array import prefix_array_build, prefix_array_extend


class LiveArena:
    """Live sequences as regions of one token arena and one prefix-array arena.

    Flat arrays (not a list of arrays) so the compiled kernels take them at no unboxing cost. A
    sequence that outgrows its region moves to a region twice as big at the end; the arena is
    compacted when more than half of it is dead space.
    """

    def __init__(self) -> None:
        self.tok = np.zeros(0, dtype=np.int32)
        self.pa = np.zeros(0, dtype=np.int32)
        self.used = 0  # arena prefix in use (live regions and dead space)
        self.regions: dict[int, list[int]] = {}  # seq_id -> [base, capacity, length]

    def tokens(self, seq_id: int) -> np.ndarray:
        base, _, n = self.regions[seq_id]
        return self.tok[base : base + n]

    def nbytes(self) -> int:
        return self.tok.nbytes + self.pa.nbytes

    def start(self, seq_id: int, tokens: np.ndarray, depth: int) -> None:
        self.restore(seq_id, tokens, prefix_array_build(tokens))  # one sort, not n insertions

    def restore(self, seq_id: int, tokens: np.ndarray, pa: np.ndarray) -> None:
        """A sequence with its prefix array already built (a saved one: no sort)."""
        cap = max(64, 2 * len(tokens))
        base = self._allocate(cap)
        self.tok[base : base + len(tokens)] = tokens
        self.pa[base : base + len(tokens)] = pa
        self.regions[seq_id] = [base, cap, len(tokens)]

    def extend(self, seq_id: int, tokens: np.ndarray, depth: int) -> None:
        region = self.reserve(seq_id, len(tokens))
        base, cap, n = region
        self.tok[base + n : base + n + len(tokens)] = tokens
        prefix_array_extend(self.tok[base : base + cap], self.pa[base : base + cap], n, n + len(tokens), depth)
        region[2] = n + len(tokens)

    def reserve(self, seq_id: int, extra: int) -> list[int]:
        """Room for `extra` more tokens in the sequence's region (it moves when full); its region."""
        region = self.regions[seq_id]
        base, cap, n = region
        if n + extra > cap:
            new_cap = max(n + extra, 2 * cap)
            new_base = self._allocate(new_cap)
            base = region[0]  # _allocate may have compacted the arena
            self.tok[new_base : new_base + n] = self.tok[base : base + n]
            self.pa[new_base : new_base + n] = self.pa[base : base + n]
            region[0], region[1] = new_base, new_cap
        return region

    def remove(self, seq_id: int) -> None:
        del self.regions[seq_id]
        if not self.regions:
            self.used = 0

    def _allocate(self, cap: int) -> int:
        live = sum(r[1] for r in self.regions.values())
        if self.used + cap > len(self.tok) and live + cap <= len(self.tok) // 2:
            self._compact()
        if self.used + cap > len(self.tok):
            size = max(2 * len(self.tok), live + cap + 1024)
            for name in ("tok", "pa"):
                old = getattr(self, name)
                new = np.empty(size, dtype=np.int32)
                new[: self.used] = old[: self.used]
                setattr(self, name, new)
        base = self.used
        self.used += cap
        return base

    def _compact(self) -> None:
        pos = 0
        for region in sorted(self.regions.values()):
            base, cap, n = region
            self.tok[pos : pos + n] = self.tok[base : base + n]
            self.pa[pos : pos + n] = self.pa[base : base + n]
            region[0] = pos
            pos += cap
        self.used = pos
