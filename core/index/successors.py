"""The successor table: for each token, the tokens the model itself most often put next.

Every verification pass computes the model's whole next-token distribution on every row it reads
(the pending tokens and each draft node); the decode loop keeps one token of each. Token Recycling
(Luo et al., 2024, "Turning Trash into Treasure") keeps the top k of every row instead, in a table
token -> its likely successors, and drafts a tree from it by best-first expansion: no second model,
no training, and it proposes exactly the continuations no log has shown, which no suffix index can.

A row read after token x updates x's entry: its k most likely next tokens and their probabilities,
the newest row replacing the old one (what the model predicted after x most recently: the table
follows the workload, as Token Recycling's did). A draft from the table is a tree rooted at the
context's last token, each node's D the product of the probabilities along its path, grown best
first to `max_nodes`.

>>> table = SuccessorTable(10, k=2)
>>> table.learn([3, 4], [[4, 5], [6, 7]], [[0.8, 0.1], [0.9, 0.05]])
>>> draft = table.draft(3, max_nodes=3)
>>> draft.token_ids, draft.parents
([4, 6, 5], [-1, 0, -1])
"""

from __future__ import annotations

import heapq
import io
import zipfile
from collections.abc import Sequence

import numpy as np

from ..draft import TABLE, Draft

TABLE_K = 8  # successors kept per token (docs/design.md, "The successor table": the measurements)
TABLE_MATCH_LEN = 1  # a table node grew from one token of context: the acceptance model's match-length cell
_MAGIC = b"specx-successors-1\n"


class SuccessorTableError(ValueError):
    """A kept successor table that cannot be read (the message says why)."""


class SuccessorTable:
    """token -> its k likely successors (`next`, -1 where none yet) and their probabilities (`prob`),
    for one model's vocabulary of `vocab_size` tokens."""

    def __init__(self, vocab_size: int, *, k: int = TABLE_K) -> None:
        if vocab_size < 1 or k < 1:
            raise ValueError(f"a successor table needs vocab_size >= 1 and k >= 1, got {vocab_size} and {k}")
        self.next = np.full((vocab_size, k), -1, dtype=np.int32)  # [V, k]
        self.prob = np.zeros((vocab_size, k), dtype=np.float16)  # [V, k]
        self.rows_learned = 0  # rows written since this table was made or loaded

    @property
    def vocab_size(self) -> int:
        return self.next.shape[0]

    @property
    def k(self) -> int:
        return self.next.shape[1]

    def __len__(self) -> int:
        """Tokens that have an entry."""
        return int(np.count_nonzero(self.next[:, 0] >= 0))

    def learn(self, tokens: Sequence[int] | np.ndarray, top_ids: Sequence[Sequence[int]] | np.ndarray,
              top_probs: Sequence[Sequence[float]] | np.ndarray) -> None:
        """Rows read after `tokens` [R] predicted `top_ids` [R, >= k] with `top_probs` [R, >= k]
        (most likely first): each token's entry becomes its row's first k (a token read twice: its
        last row)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not len(tokens):
            return
        ids = np.asarray(top_ids)[:, : self.k]
        probs = np.asarray(top_probs)[:, : self.k]
        last = len(tokens) - 1 - np.unique(tokens[::-1], return_index=True)[1]  # each token's last row
        keep = last[(tokens[last] >= 0) & (tokens[last] < self.vocab_size)]
        self.next[tokens[keep], : ids.shape[1]] = ids[keep]
        self.prob[tokens[keep], : ids.shape[1]] = probs[keep]
        self.rows_learned += len(keep)

    def draft(self, last: int, *, max_nodes: int, min_prob: float = 0.0) -> Draft:
        """The best-first tree after `last` (the context's last token): the `max_nodes` paths' nodes
        with the highest products of probabilities, each above `min_prob`, tagged TABLE."""
        return self.grow(Draft(), [(-1, last, 1.0)], max_nodes=max_nodes, min_prob=min_prob)

    def grow(self, draft: Draft, seeds: Sequence[tuple[int, int, float]], *, max_nodes: int,
             min_prob: float = 0.0) -> Draft:
        """`draft` with up to `max_nodes` table nodes grown best first (highest D) beneath its
        `seeds`: (node, its token, its D), node -1 being the context (its token the context's last).
        A table node's D is its seed's times the probabilities along its path. A node the draft
        already has there is shared (it gains the TABLE bit and the higher D) and grows on. New
        nodes are tagged TABLE (match length TABLE_MATCH_LEN).

        >>> table = SuccessorTable(10, k=1)
        >>> table.learn([2, 5], [[5], [6]], [[0.5], [0.8]])
        >>> grown = table.grow(Draft([1, 2], [-1, 0], [0.9, 0.6], 1.5, 3), [(1, 2, 0.6)], max_nodes=4)
        >>> grown.token_ids, grown.parents, [round(p, 2) for p in grown.probs]
        ([1, 2, 5, 6], [-1, 0, 1, 2], [0.9, 0.6, 0.3, 0.24])
        """
        tokens, parents, probs = list(draft.token_ids), list(draft.parents), list(draft.probs)
        sources, lens = draft.node_tags()
        node_at = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
        frontier: list[tuple[float, int, int, int]] = []  # (-D, order, parent node, token)
        order = 0

        def push(parent: int, token: int, above: float) -> None:
            nonlocal order
            if not 0 <= token < self.vocab_size:
                return
            for tok, p in zip(self.next[token].tolist(), self.prob[token].tolist()):
                d = above * p
                if tok < 0 or d <= min_prob:
                    break  # entries are most likely first
                heapq.heappush(frontier, (-d, order, parent, tok))
                order += 1

        for node, token, d in seeds:
            push(node, token, d)
        added = 0
        while frontier and added < max_nodes:
            neg_d, _, parent, tok = heapq.heappop(frontier)
            j = node_at.get((parent, tok))
            if j is None:
                j = node_at[(parent, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                probs.append(-neg_d)
                sources.append(TABLE)
                lens.append(TABLE_MATCH_LEN)
                added += 1
            else:
                probs[j] = max(probs[j], -neg_d)
                sources[j] |= TABLE
                lens[j] = max(lens[j], TABLE_MATCH_LEN)
            push(j, tok, -neg_d)
        return Draft(tokens, parents, probs, float(sum(probs)), max(draft.match_len, TABLE_MATCH_LEN), sources, lens)

    def merge(self, other: SuccessorTable) -> None:
        """Take in another table of the same vocabulary (a replica's): each token's entry becomes the
        k most likely of both entries' successors (a successor in both: its higher probability)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge successor tables of {other.vocab_size} and {self.vocab_size} tokens")
        both = np.flatnonzero((other.next[:, 0] >= 0) & (self.next[:, 0] >= 0))
        only = np.flatnonzero((other.next[:, 0] >= 0) & (self.next[:, 0] < 0))
        k = min(self.k, other.k)
        self.next[only, :k], self.prob[only, :k] = other.next[only, :k], other.prob[only, :k]
        for tok in both.tolist():
            best: dict[int, float] = {}
            for nxt, p in zip([*self.next[tok].tolist(), *other.next[tok].tolist()],
                              [*self.prob[tok].tolist(), *other.prob[tok].tolist()]):
                if nxt >= 0 and p > best.get(nxt, -1.0):
                    best[nxt] = p
            ranked = sorted(best.items(), key=lambda item: -item[1])[: self.k]
            self.next[tok] = -1
            self.prob[tok] = 0
            self.next[tok, : len(ranked)] = [t for t, _ in ranked]
            self.prob[tok, : len(ranked)] = [p for _, p in ranked]

    def to_bytes(self) -> bytes:
        """The table as bytes (numpy's npz of the two arrays after a header), for the store."""
        out = io.BytesIO()
        out.write(_MAGIC)
        np.savez(out, next=self.next, prob=self.prob)
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, *, vocab_size: int | None = None) -> SuccessorTable:
        """A table written by to_bytes; SuccessorTableError says what is wrong, as a phrase that
        follows "the table is" (not a specx successor table; damaged: its arrays declare 100
        tokens, the model has 49,152). The arrays' declared shapes and dtypes are checked before
        anything is allocated (core.kept_schema.check_table: vocab x k, k of 1 to 32), and only
        uncompressed members are read, as np.savez writes them: a few hundred bytes that declare,
        or inflate to, gigabytes are refused unread."""
        if not isinstance(data, bytes) or not data.startswith(_MAGIC):
            raise SuccessorTableError("not a specx successor table (its header is missing)")
        payload = io.BytesIO(data[len(_MAGIC):])
        try:
            _check_members(payload, vocab_size)
            with np.load(payload, allow_pickle=False) as arrays:
                nxt, prob = arrays["next"], arrays["prob"]
        except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise SuccessorTableError(str(exc) if str(exc).startswith("damaged") else f"damaged: {exc}") from None
        if nxt.size and (nxt.min() < -1 or nxt.max() >= nxt.shape[0]):
            raise SuccessorTableError("damaged: a successor outside the vocabulary")
        table = cls(nxt.shape[0], k=nxt.shape[1])
        table.next[:], table.prob[:] = nxt, prob
        return table


def _check_members(payload: io.BytesIO, vocab_size: int | None) -> None:
    """Check the npz in `payload` by its members' headers alone (core.kept_schema.check_table);
    ValueError (core.kept.Unusable) or zipfile.BadZipFile saying what is wrong."""
    from ..kept_schema import TABLE_DTYPES, check_table

    declared = {}
    with zipfile.ZipFile(payload) as archive:
        for info in archive.infolist():
            name = info.filename.removesuffix(".npy")
            if name not in TABLE_DTYPES:
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"damaged: its {name} array is compressed inside (specx writes it as it is)")
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(member)
            declared[name] = (tuple(shape), dtype.name)
    check_table(declared, vocab_size)
    payload.seek(0)
