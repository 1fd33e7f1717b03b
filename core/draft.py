"""The draft: a token tree proposed for one verification step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Draft:
    """Draft tokens as a tree in flat form (same vocabulary as the reference implementation).

    parents[i] < i is the index of node i's parent, -1 for a child of the matched context; a linear
    draft has parents [-1, 0, 1, ...]. probs[i] is D(node i), the estimated chance the verifier
    accepts it; score is their sum (expected accepted tokens); match_len is the length p of the
    context suffix the draft grew from.

    >>> Draft([5, 6], [-1, 0], [0.5, 0.25], 0.75, 3).depths()
    [1, 2]
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        """Depth of each node (1 for a root)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf token path (a linear draft has one)."""
        has_child = [False] * len(self.token_ids)
        for p in self.parents:
            if p >= 0:
                has_child[p] = True
        out = []
        for i, leaf in enumerate(has_child):
            if not leaf:
                path = []
                j = i
                while j >= 0:
                    path.append(self.token_ids[j])
                    j = self.parents[j]
                out.append(path[::-1])
        return out

    def accepted_len(self, continuation: list[int]) -> int:
        """Longest draft path that equals a prefix of `continuation` (the simulated verifier)."""
        best = 0
        node_at: dict[tuple[int, int], int] = {}
        for i, (tok, par) in enumerate(zip(self.token_ids, self.parents)):
            node_at.setdefault((par, tok), i)
        parent = -1
        for depth, tok in enumerate(continuation):
            nxt = node_at.get((parent, tok))
            if nxt is None:
                break
            parent = nxt
            best = depth + 1
        return best
