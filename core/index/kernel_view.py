"""The kernels' view of a suffix index: its sealed and live parts as the one flat tuple of arrays
every compiled kernel takes (expand.speculate_index, children.node_children, engine_step's
draft_path), so that a call unboxes no Python objects.

In order: the sealed text and suffix array; each segment's bounds in the suffix array (lo, hi),
the offset of its first-token table in the tables' one array (-1: it has none) and that table's
vocabulary; the tables; the live token and prefix-array arenas; each live sequence's base and
length in them, in the order of the arena's regions (a sequence's slot). SuffixIndex makes the
view again when its layout changes (`make_view`) and keeps it while the layout holds: an append
moves only live lengths and bases, which `sync_live` writes in place, so the view stays the same
object (what engine_step's StepArgs checks).
"""

from __future__ import annotations

import numpy as np

from .live import LiveArena
from .sealed import Sealed


def make_view(sealed: Sealed, live: LiveArena) -> tuple:
    """The kernels' view of `sealed` and `live`: text, sa, segment bounds and tables, live arenas,
    bases, lengths (see the module docstring)."""
    regions = list(live.regions.values())
    offsets, vocabs, parts, at = [], [], [], 0
    for table in sealed.tables():
        offsets.append(at if table is not None else -1)
        vocabs.append(len(table) - 1 if table is not None else 0)
        if table is not None:
            parts.append(table)
            at += len(table)
    return (
        sealed.text, sealed.sa,
        np.array([s.sa_lo for s in sealed.segments], dtype=np.int64),
        np.array([s.sa_hi for s in sealed.segments], dtype=np.int64),
        np.array(offsets, dtype=np.int64), np.array(vocabs, dtype=np.int64),
        np.concatenate(parts) if parts else np.zeros(1, dtype=np.int32),
        live.tok, live.pa,
        np.array([r[0] for r in regions], dtype=np.int64),
        np.array([r[2] for r in regions], dtype=np.int64),
    )


def sync_live(view: tuple, live: LiveArena) -> None:
    """Appends change live lengths (and, after a move, bases) in place; the arenas stay the same
    objects, so `view` stays valid once its bases and lengths are written again."""
    bases, lens = view[-2:]
    for k, (base, _, n) in enumerate(live.regions.values()):
        bases[k] = base
        lens[k] = n
