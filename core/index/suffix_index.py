"""The suffix index: many token sequences, exact pattern counts, drafts in microseconds.

An enhanced suffix array instead of a pointer tree (docs/design.md, "The index"): sealed (finished)
sequences in one text and one suffix array of sorted segments that merge like a binary counter
(core/index/sealed.py); live sequences (the request index: prompt plus output so far) in a prefix array
that takes one token in O(log n) (core/index/live.py). Everything is flat arrays: the compiled
kernels take them as one tuple (core/index/kernel_view.py), `to_bytes` writes them, `from_bytes`
maps them back without a rebuild.

>>> index = SuffixIndex.build([[1, 2, 3, 1, 2, 4]])
>>> index.count([1, 2]), index.children([1, 2])
(2, {3: 1, 4: 1})
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ..draft import Draft
from . import index_format
from .children import node_children
from .expand import speculate_index
from .kernel_view import make_view, sync_live
from .live import LiveArena
from .sealed import Sealed
from .prefix_array import prefix_narrow
from .suffix_array import SORT_DEPTH, forward_ranges
from .tokens import MAX_TOKEN, SuffixIndexError, check_tokens

MAX_DEPTH_LIMIT = SORT_DEPTH // 2


class SuffixIndex:
    """Suffix index over many token sequences; see the module docstring."""

    def __init__(self, max_depth: int = 64, vocab_size: int | None = None, budget_bytes: int | None = None) -> None:
        if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
            raise SuffixIndexError(f"max_depth must be in [1, {MAX_DEPTH_LIMIT}], got {max_depth}")
        if vocab_size is not None and not 1 <= vocab_size <= MAX_TOKEN + 1:
            raise SuffixIndexError(f"vocab_size must be in [1, {MAX_TOKEN + 1}], got {vocab_size}")
        if budget_bytes is not None and budget_bytes < 0:
            raise SuffixIndexError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.max_depth = max_depth
        self.vocab_size = vocab_size
        self.budget_bytes = budget_bytes
        self.sealed = Sealed()  # finished sequences
        self.live = LiveArena()  # sequences still growing
        self.next_id = 0  # the id the next sequence gets
        self._kernel_args: tuple | None = None
        self._slots: dict[int, int] = {}  # live sequence id -> its position in the kernel args' live arrays
        self._out_tok = np.empty(32, dtype=np.int32)  # draft output buffers, reused across calls
        self._out_par = np.empty(32, dtype=np.int32)
        self._out_prob = np.empty(32, dtype=np.float64)

    # ----------------------------------------------------------------- building

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], max_depth: int = 64, vocab_size: int | None = None,
              budget_bytes: int | None = None) -> "SuffixIndex":
        """Bulk build: all sequences sealed in one segment (one sort, no merges)."""
        index = cls(max_depth, vocab_size, budget_bytes)
        index.add_many(sequences)
        return index

    def add(self, tokens: Sequence[int]) -> int:
        """Add a finished sequence; returns its id. May merge segments and evict old sequences."""
        return self.add_many([check_tokens(tokens, self.vocab_size)])[0]

    def add_many(self, sequences: Iterable[Sequence[int]]) -> list[int]:
        """Add finished sequences in one sealed segment (one sort), then merge and evict as `add`
        does; returns their ids. Without a byte budget, every count and draft after it is what
        adding them one by one gives (tests/test_suffix_index.py)."""
        parts = [check_tokens(seq, self.vocab_size, f"sequence {i}") for i, seq in enumerate(sequences)]
        if not parts:
            return []
        ids = list(range(self.next_id, self.next_id + len(parts)))
        self.next_id += len(parts)
        self.sealed.add(parts, ids)
        self._kernel_args = None
        self._enforce_budget()
        return ids

    def head(self, num_sequences: int) -> "SuffixIndex":
        """A new index of the oldest `num_sequences` sealed sequences, made without sorting: each
        segment keeps its suffixes that start in them, in the order they have here (a subsequence
        of a sorted block stays sorted, as when the oldest are evicted, and no pattern crosses the
        SEP that ends a sequence). Every count and draft equals that of an index they were added to
        one by one. The text is shared (appends to either index reallocate, never overwrite).

        >>> SuffixIndex.build([[1, 2, 3], [1, 2, 4]]).head(1).children([1, 2])
        {3: 1}
        """
        num_docs = len(self.sealed.doc_ids)
        if not 0 <= num_sequences <= num_docs:
            raise SuffixIndexError(f"head({num_sequences}): the index holds {num_docs} sealed sequences")
        out = SuffixIndex(self.max_depth, self.vocab_size, self.budget_bytes)
        out.sealed, out.next_id = self.sealed.head(num_sequences), self.next_id
        return out

    def start(self, tokens: Sequence[int] = ()) -> int:
        """Start a live sequence (e.g. a request's prompt); returns its id."""
        arr = check_tokens(tokens, self.vocab_size)
        seq_id = self.next_id
        self.next_id += 1
        self.live.start(seq_id, arr, self.max_depth)
        self._kernel_args = None
        return seq_id

    def append(self, seq_id: int, tokens: Sequence[int], checked: bool = False) -> None:
        """Append tokens to a live sequence; they match at once. `checked`: `tokens` came from
        check_tokens and `seq_id` is live (a hot path's promise; nothing is checked then)."""
        if checked:
            self._append(seq_id, tokens)  # type: ignore[arg-type]
            return
        self._get_live(seq_id)
        self._append(seq_id, check_tokens(tokens, self.vocab_size))

    def _append(self, seq_id: int, arr: np.ndarray) -> None:
        # Tokens already checked (the drafter's hot path).
        arena = self.live.tok
        self.live.extend(seq_id, arr, self.max_depth)
        if self.live.tok is not arena or self._kernel_args is None:
            self._kernel_args = None
        else:
            sync_live(self._kernel_args, self.live)

    def hot_args(self, seq_id: int, room: int = 0) -> tuple[tuple, int, int]:
        """For a kernel that appends in place (core.index.engine_step): the kernels' view of the index
        (kernel_view) with room for `room` more tokens in live sequence `seq_id`, that sequence's slot
        in the view's live arrays, and the tokens its region holds before it must move. Tell the index
        with `appended` what the kernel appended."""
        self._get_live(seq_id)
        arena, cap = self.live.tok, self.live.regions[seq_id][1]
        region = self.live.reserve(seq_id, room)
        if self.live.tok is not arena:
            self._kernel_args = None
        elif self._kernel_args is not None and region[1] != cap:
            sync_live(self._kernel_args, self.live)  # the region moved (and a compaction moves others)
        return self._args(), self._slots[seq_id], region[1]

    def kernel_view(self) -> tuple:
        """The kernels' view of the index (arrays; the same object until the index's layout changes)."""
        return self._args()

    def appended(self, seq_id: int, num: int) -> None:
        """A kernel appended `num` tokens to live sequence `seq_id` through hot_args' view (its
        lengths array is up to date already)."""
        self.live.regions[seq_id][2] += num

    def live_tokens(self, seq_id: int) -> np.ndarray:
        """A live sequence's tokens so far (a view: valid until the next append)."""
        self._get_live(seq_id)
        return self.live.tokens(seq_id)

    def finish(self, seq_id: int) -> int:
        """Seal a live sequence as a finished one (it keeps its id); returns the id."""
        self._get_live(seq_id)
        self.sealed.add([self.live.tokens(seq_id)], [seq_id])
        self.live.remove(seq_id)
        self._kernel_args = None
        self._enforce_budget()
        return seq_id

    def discard(self, seq_id: int) -> None:
        """Drop a live sequence without keeping it."""
        self._get_live(seq_id)
        self.live.remove(seq_id)
        self._kernel_args = None

    def compact(self) -> None:
        """Merge all sealed segments into one (fastest queries; one full sort)."""
        while len(self.sealed.segments) >= 2:
            self.sealed.merge_last_two()
        self._kernel_args = None

    def evict(self, budget_bytes: int) -> int:
        """Drop the oldest sealed sequences until nbytes <= budget_bytes; returns how many were dropped."""
        if budget_bytes < 0:
            raise SuffixIndexError(f"budget_bytes must be >= 0, got {budget_bytes}")
        doc_bytes = self.sealed.doc_bytes()
        # Bytes the remaining sequences will need once compacted, plus live sequences, plus today's
        # first-token tables (dropping sequences never makes a table larger).
        fixed = self.live.nbytes() + self.sealed.table_bytes()
        remaining, drop = sum(doc_bytes), 0
        while drop < len(doc_bytes) and fixed + remaining > budget_bytes:
            remaining -= doc_bytes[drop]
            drop += 1
        if drop or self.nbytes > budget_bytes:
            self.sealed.drop_oldest(drop)  # also trims spare capacity
            self._kernel_args = None
        return drop

    # ----------------------------------------------------------------- queries

    @property
    def num_sequences(self) -> int:
        return len(self.sealed.doc_ids) + len(self.live.regions)

    @property
    def num_tokens(self) -> int:
        return self.sealed.sa_len + sum(r[2] for r in self.live.regions.values())

    @property
    def nbytes(self) -> int:
        """Resident bytes of the index arrays (capacity, not just the used part)."""
        return self.sealed.nbytes + self.live.nbytes()

    def sequences(self) -> Iterator[tuple[int, np.ndarray]]:
        """(id, tokens) of every sequence, sealed ones oldest first, then live ones."""
        yield from self.sealed.sequences()
        for seq_id in self.live.regions:
            yield seq_id, self.live.tokens(seq_id)

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` over all sequences (the empty pattern counts every token)."""
        flo, fhi, occ_doc, occ_start, total = self._node(pattern)
        return total

    def children(self, pattern: Sequence[int]) -> dict[int, int]:
        """{next token: count} over the occurrences of `pattern`."""
        pat = self._check_pattern(pattern)
        flo, fhi, occ_doc, occ_start, total = self._node(pat)
        if total == 0:
            return {}
        text, sa, *_, live_tok, _, live_base, live_len = self._args()
        tok, cnt = node_children(text, sa, flo, fhi, live_tok, live_base, live_len, occ_doc, occ_start,
                                 len(pat), total)
        return dict(zip(tok.tolist(), cnt.tolist()))

    def speculate(self, context: Sequence[int], max_spec_tokens: int = 32, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1, tree: bool = True, *,
                  floor: tuple[float, int] = (0.0, 0), checked: bool = False) -> Draft | None:
        """Best draft for `context` from this index alone, or None if none beats `floor` (score, match_len).
        `checked`: `context` came from check_tokens and the other arguments passed check_speculate_args."""
        if checked:
            return self._speculate(context, max_spec_tokens, max_spec_factor, min_token_prob, tree,  # type: ignore[arg-type]
                                   floor=floor)
        ctx = check_tokens(context, self.vocab_size, "context")
        check_speculate_args(ctx, max_spec_tokens, max_spec_factor, min_token_prob, self.max_depth)
        return self._speculate(ctx, max_spec_tokens, max_spec_factor, min_token_prob, tree, floor=floor)

    def _speculate(self, ctx: np.ndarray, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                   tree: bool, *, floor: tuple[float, int]) -> Draft | None:
        # Arguments already checked (the drafter's hot path).
        if len(self._out_tok) < max_spec_tokens:
            self._out_tok = np.empty(max_spec_tokens, dtype=np.int32)
            self._out_par = np.empty(max_spec_tokens, dtype=np.int32)
            self._out_prob = np.empty(max_spec_tokens, dtype=np.float64)
        num, score, match_len, improved = speculate_index(
            *self._args(), ctx, self.max_depth,
            max_spec_tokens, float(max_spec_factor), float(min_token_prob), bool(tree),
            float(floor[0]), int(floor[1]), self._out_tok, self._out_par, self._out_prob)
        if not improved:
            return None
        return Draft(self._out_tok[:num].tolist(), self._out_par[:num].tolist(), self._out_prob[:num].tolist(),
                     score, match_len)

    # ----------------------------------------------------------------- persistence

    def text(self) -> np.ndarray:
        """The sealed sequences as stored: each followed by SEP, oldest first (see to_bytes)."""
        return self.sealed.text[: self.sealed.text_len]

    def to_bytes(self, include_text: bool = True) -> bytes:
        """Flat serialisation (see index_format.dump); without the text, the compact form."""
        return index_format.dump(self, include_text)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, text: np.ndarray | None = None) -> "SuffixIndex":
        """Load without re-sorting (see index_format.load); `text` when it was left out."""
        return index_format.load(cls, data, text)

    # ----------------------------------------------------------------- internals

    def _get_live(self, seq_id: int) -> None:
        if seq_id not in self.live.regions:
            raise SuffixIndexError(f"no live sequence with id {seq_id}")

    def _enforce_budget(self) -> None:
        if self.budget_bytes is not None and self.nbytes > self.budget_bytes:
            self.evict(self.budget_bytes)

    def _args(self) -> tuple:
        """The kernels' view of the index (kernel_view.py), made again after a change of layout."""
        if self._kernel_args is None:
            self._slots = {seq_id: k for k, seq_id in enumerate(self.live.regions)}
            self._kernel_args = make_view(self.sealed, self.live)
        return self._kernel_args

    def _check_pattern(self, pattern: Sequence[int]) -> np.ndarray:
        pat = check_tokens(pattern, self.vocab_size, "pattern")
        if len(pat) > self.max_depth:
            raise SuffixIndexError(f"pattern has {len(pat)} tokens; this index answers up to max_depth={self.max_depth}")
        return pat

    def _node(self, pattern: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """A pattern's node: sealed ranges, live occurrence starts, total count."""
        pat = self._check_pattern(pattern)
        text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, live_tok, live_pa, live_base, live_len = self._args()
        flo, fhi, total = forward_ranges(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pat)
        docs, starts = [], []
        p = len(pat)
        for j in range(len(live_len)):
            n, base = int(live_len[j]), int(live_base[j])
            if p == 0:
                begins = np.arange(n, dtype=np.int64)
            else:
                lo, hi = 0, n
                for k in range(p):
                    lo, hi = prefix_narrow(live_tok, live_pa, base, lo, hi, k, int(pat[p - 1 - k]))
                begins = live_pa[base + lo : base + hi].astype(np.int64) - p + 1
            docs.append(np.full(len(begins), j, dtype=np.int64))
            starts.append(begins)
        occ_doc = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        occ_start = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
        return flo, fhi, occ_doc, occ_start, int(total) + len(occ_doc)


def check_speculate_args(context: np.ndarray | None, max_spec_tokens: int, max_spec_factor: float,
                         min_token_prob: float, max_depth: int) -> None:
    """ValueError for arguments the drafting kernel must never see (context None: parameters only)."""
    if context is not None and len(context) == 0:
        raise SuffixIndexError("context is empty: speculation needs at least one token to match")
    if not 1 <= max_depth <= MAX_DEPTH_LIMIT:
        raise SuffixIndexError(f"max_depth must be in [1, {MAX_DEPTH_LIMIT}], got {max_depth}")
    if not 0 <= max_spec_tokens <= SORT_DEPTH - max_depth:
        raise SuffixIndexError(f"max_spec_tokens must be in [0, {SORT_DEPTH - max_depth}], got {max_spec_tokens}")
    if not (max_spec_factor >= 0 and math.isfinite(max_spec_factor)):
        raise SuffixIndexError(f"max_spec_factor must be a finite number >= 0, got {max_spec_factor}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise SuffixIndexError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
