"""The draft: a token tree proposed for one verification step, and what is done to trees: `subtree`,
the tree cut to a kept set; the model's guesses and a grammar's forced tokens as drafts to merge in
(`add_guesses`, `forced_draft`); the best path, for a verifier of linear drafts (`best_path`); the
tree cut to a depth (`limit_depth`). core.decode.loop.shape_draft applies them in its order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Draft.sources bits: the request's own index, the global index of past outputs, the model's own
# guess (core.decode.loop adds the previous pass's guesses as roots: see core.decode.loop.Verdict.guesses),
# a client's prediction of the output (core.decode.speculate.PredictionDrafter) and the tokens a grammar
# forces (core.decode.grammar.Constraint.forced), and the model's successor table
# (core.index.successors, drafted by core.decode.hybrid.HybridDrafter)
REQUEST, GLOBAL, MODEL, PREDICTION, GRAMMAR, TABLE = 1, 2, 4, 8, 16, 32


@dataclass
class Draft:
    """Draft tokens as a tree in flat form (same vocabulary as the reference implementation).

    parents[i] < i is the index of node i's parent, -1 for a child of the matched context; a linear
    draft has parents [-1, 0, 1, ...]. probs[i] is D(node i), the estimated chance the verifier
    accepts it; score is their sum (expected accepted tokens); match_len is the length p of the
    context suffix the draft grew from. Optionally per node: sources[i], who proposed it
    (a bit mask: REQUEST, GLOBAL, MODEL), and match_lens[i], the match its index grew it from (a merged
    draft's nodes come from different matches); core.cost.acceptance.AcceptanceModel reads both.

    >>> Draft([5, 6], [-1, 0], [0.5, 0.25], 0.75, 3).depths()
    [1, 2]
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    sources: list[int] = field(default_factory=list)
    match_lens: list[int] = field(default_factory=list)

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

    def walk(self, choose: Callable[[int, int], int | None]) -> tuple[list[int], list[int]]:
        """The accept walk, for the model's verifier (core.decode.verify.accept) and for a recorded output
        (accepted_nodes): from the root, `choose(node, depth)` is the token chosen after `node` (-1:
        the root; depth: nodes passed so far); move to the child that carries it, else stop. Returns
        (tokens chosen, nodes passed): the last token is the bonus token unless `choose` gave None.
        """
        children: dict[tuple[int, int], int] = {}
        for i, (tok, par) in enumerate(zip(self.token_ids, self.parents)):
            children.setdefault((par, int(tok)), i)
        tokens: list[int] = []
        nodes: list[int] = []
        node = -1
        while True:
            tok = choose(node, len(nodes))
            if tok is None:
                return tokens, nodes
            tokens.append(tok)
            nxt = children.get((node, tok))
            if nxt is None:
                return tokens, nodes
            nodes.append(nxt)
            node = nxt

    def accepted_nodes(self, continuation: Sequence[int]) -> list[int]:
        """Indices of the nodes along the longest path that equals a prefix of `continuation`: the
        greedy verifier's walk when `continuation` is what the model would write."""
        return self.walk(lambda node, depth: int(continuation[depth]) if depth < len(continuation) else None)[1]

    def accepted_path(self, continuation: Sequence[int]) -> list[int]:
        """Draft tokens along `accepted_nodes(continuation)`."""
        return [self.token_ids[i] for i in self.accepted_nodes(continuation)]

    def tagged(self, source: int) -> "Draft":
        """The same draft with every node's source set to `source` and its match length to match_len."""
        n = len(self.token_ids)
        return Draft(self.token_ids, self.parents, self.probs, self.score, self.match_len, [source] * n,
                     [self.match_len] * n)

    def accepted_len(self, continuation: Sequence[int]) -> int:
        """Length of `accepted_path`."""
        return len(self.accepted_path(continuation))

    def merge(self, other: "Draft", limit: int) -> "Draft":
        """The union of two draft trees (self's nodes first), at most `limit` nodes.

        Shared prefixes become shared nodes (keeping the higher D, the union of the sources and
        the longer match); other's nodes follow in their best-first order while room remains. A
        verifier accepts at least as much from the union as from either tree: every path of each
        is still a path. (SpecInfer merges the token trees of several drafters the same way.)

        >>> Draft([3, 4], [-1, 0], [0.9, 0.5], 1.4, 2).merge(Draft([3, 5], [-1, 0], [0.6, 0.6], 1.2, 1), 8).token_ids
        [3, 4, 5]
        """
        tokens, parents, probs = list(self.token_ids), list(self.parents), list(self.probs)
        sources, lens = self.node_tags()
        other_sources, other_lens = other.node_tags()
        node_at = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
        mapped: dict[int, int] = {}
        for i, (tok, par, prob) in enumerate(zip(other.token_ids, other.parents, other.probs)):
            parent = -1 if par < 0 else mapped.get(par)
            if parent is None:
                continue  # its parent did not fit
            j = node_at.get((parent, tok))
            if j is None:
                if len(tokens) >= limit:
                    continue
                j = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                probs.append(prob)
                sources.append(other_sources[i])
                lens.append(other_lens[i])
                node_at[(parent, tok)] = j
            else:
                probs[j] = max(probs[j], prob)
                sources[j] |= other_sources[i]
                lens[j] = max(lens[j], other_lens[i])
            mapped[i] = j
        return Draft(tokens, parents, probs, float(sum(probs)), max(self.match_len, other.match_len), sources, lens)

    def union(self, other: "Draft", limit: int) -> "Draft":
        """The two drafts verified together: the better one first (higher score, then longer match;
        a tie keeps self), then the other's nodes while `limit` allows (see merge).

        >>> Draft([3], [-1], [0.5], 0.5, 1).union(Draft([4], [-1], [0.9], 0.9, 1), 8).token_ids
        [4, 3]
        """
        first, second = (other, self) if (other.score, other.match_len) > (self.score, self.match_len) else (self, other)
        return first.merge(second, limit) if len(second) else first

    def better_path(self, other: "Draft") -> "Draft":
        """For two linear drafts, the path of their merged tree (`self.merge(other)`) with the highest
        expected accepted length (the sum of D along it), without building the tree: they share a
        prefix (where the merge keeps the higher D) and then part. An engine that verifies one path
        per step gets this. (tests/brute.py's best_path is the reference for any tree.)

        >>> Draft([3, 4], [-1, 0], [0.9, 0.5], 1.4, 2).better_path(Draft([3, 5, 6], [-1, 0, 1], [0.6, 0.6, 0.3], 1.5, 1)).token_ids
        [3, 5, 6]
        """
        if not other.token_ids:
            return self
        if not self.token_ids:
            return other
        shared = 0
        for a, b in zip(self.token_ids, other.token_ids):
            if a != b:
                break
            shared += 1
        head = [max(a, b) for a, b in zip(self.probs[:shared], other.probs[:shared])]
        mine, theirs = sum(head) + sum(self.probs[shared:]), sum(head) + sum(other.probs[shared:])
        best, score = (other, theirs) if theirs > mine else (self, mine)  # a tie keeps self (its nodes come first)
        probs = head + list(best.probs[shared:])
        return Draft(list(best.token_ids), list(range(-1, len(best) - 1)), probs, score,
                     max(self.match_len, other.match_len))

    def node_tags(self) -> tuple[list[int], list[int]]:
        """(sources, match_lens) per node, new lists; a draft without them: source 0, match_len."""
        n = len(self.token_ids)
        return (list(self.sources) if self.sources else [0] * n,
                list(self.match_lens) if self.match_lens else [self.match_len] * n)


def subtree(draft: Draft, keep: Sequence[bool]) -> Draft:
    """The draft's nodes where `keep` is true (their parents must be kept too), re-indexed, order kept.

    >>> subtree(Draft([5, 6, 7], [-1, 0, -1], [0.5, 0.25, 0.2], 0.95, 2), [True, False, True]).token_ids
    [5, 7]
    """
    new_index: dict[int, int] = {}
    tokens, parents = [], []
    for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents)):
        if keep[i] and (par < 0 or par in new_index):
            new_index[i] = len(tokens)
            tokens.append(tok)
            parents.append(-1 if par < 0 else new_index[par])
    kept = list(new_index)
    pick = lambda values: [values[i] for i in kept] if values else []  # noqa: E731
    probs = pick(draft.probs)
    return Draft(tokens, parents, probs, float(sum(probs)), draft.match_len, pick(draft.sources),
                 pick(draft.match_lens))


def check_draft(draft: Draft, vocab_size: int) -> None:
    """ValueError unless the draft is a well-formed tree over this vocabulary."""
    if not (len(draft.token_ids) == len(draft.parents)):
        raise ValueError(f"draft has {len(draft.token_ids)} tokens but {len(draft.parents)} parents")
    for i, (tok, par) in enumerate(zip(draft.token_ids, draft.parents)):
        if not -1 <= par < i:
            raise ValueError(f"draft node {i} has parent {par}; parents must satisfy -1 <= parent < index")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"draft node {i} carries token {tok}, outside the vocabulary (size {vocab_size})")


GUESS_PROB = 0.5  # a guess's D before the acceptance model has seen guesses verified


def add_guesses(draft: Draft, guesses: Sequence[int]) -> Draft:
    """The draft with the model's guesses (Verdict.guesses) as extra roots, tagged MODEL; a root
    the drafter proposed too keeps its place and gains the MODEL bit.

    >>> add_guesses(Draft([5, 6], [-1, 0], [0.9, 0.5], 1.4, 2).tagged(1), [5, 8]).sources
    [5, 1, 4]
    """
    guess = Draft(list(guesses), [-1] * len(guesses), [GUESS_PROB] * len(guesses), GUESS_PROB * len(guesses), 1)
    return draft.merge(guess.tagged(MODEL), len(draft) + len(guesses))


def best_path(draft: Draft, probs: Sequence[float] | None = None) -> Draft:
    """The draft's root-to-node path with the highest expected accepted length (the sum along it
    of each node's chance: `probs`, an AcceptanceModel's estimates, else the drafter's D; the first
    such path in a tie): what a verifier of linear drafts gets. The estimates matter where sources
    mix: the successor table's D is the model's own probability, which verification shows to be
    worth much less than a suffix node's D of the same size.

    >>> best_path(Draft([5, 6, 7, 8], [-1, 0, -1, 2], [0.5, 0.1, 0.4, 0.3], 1.3, 2)).token_ids
    [7, 8]
    >>> best_path(Draft([5, 6, 7, 8], [-1, 0, -1, 2], [0.5, 0.1, 0.4, 0.3], 1.3, 2), [0.9, 0.5, 0.4, 0.3]).token_ids
    [5, 6]
    """
    n = len(draft)
    if n == 0 or all(p == i - 1 for i, p in enumerate(draft.parents)):
        return draft
    if probs is None:
        probs = draft.probs if len(draft.probs) == n else [1.0] * n
    total: list[float] = []
    for par, d in zip(draft.parents, probs):
        total.append(d + (total[par] if par >= 0 else 0.0))
    node, keep = max(range(n), key=total.__getitem__), [False] * n
    while node >= 0:
        keep[node], node = True, draft.parents[node]
    return subtree(draft, keep)


FORCED_PROB = 0.95  # a forced token's D before the acceptance model has seen forced tokens verified


def forced_draft(tokens: Sequence[int]) -> Draft:
    """A grammar's forced tokens as a chain tagged GRAMMAR.

    >>> forced_draft([7, 8]).parents
    [-1, 0]
    """
    n = len(tokens)
    probs = [FORCED_PROB ** (k + 1) for k in range(n)]
    return Draft(list(tokens), list(range(-1, n - 1)), probs, float(sum(probs)), 0, [GRAMMAR] * n, [0] * n)


def limit_depth(draft: Draft, max_depth: int) -> Draft:
    """The draft's nodes of depth <= max_depth (parents re-indexed; order kept).

    >>> limit_depth(Draft([5, 6, 7], [-1, 0, -1], [0.5, 0.25, 0.2], 0.95, 2), 1).token_ids
    [5, 7]
    """
    depths = draft.depths()
    if all(d <= max_depth for d in depths):
        return draft
    return subtree(draft, [d <= max_depth for d in depths])
