"""The suffix index: many token sequences, exact pattern counts, drafts in microseconds.

An enhanced suffix array instead of a pointer tree (DESIGN.md section 3): all sealed sequences
live in one int32 text (each followed by SEP) and one int32 suffix array made of segments, each
segment a sorted block over a contiguous run of sequences. Adding a finished sequence appends a
small segment; the youngest segments merge when they grow comparable (like a binary counter, so
a token is re-sorted O(log n) times and queries visit O(log n) segments). Live sequences (the
request index: prompt plus output so far) keep a prefix array that takes one token in O(log n).
Everything is flat arrays: `to_bytes` writes them, `from_bytes` maps them back without a rebuild.

>>> index = SuffixIndex.build([[1, 2, 3, 1, 2, 4]])
>>> index.count([1, 2]), index.children([1, 2])
(2, {3: 1, 4: 1})
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from .draft import Draft
from .children import node_children
from . import index_format
from .expand import _forward_ranges, speculate_index
from .live import LiveArena
from .suffix_array import SEP, SORT_DEPTH, build_suffix_array, prefix_narrow
from .tokens import MAX_TOKEN, SuffixIndexError, check_tokens

MAX_DEPTH_LIMIT = SORT_DEPTH // 2


BUCKET_MIN_TOKENS = 4096  # smaller segments stay in cache: binary search is as fast there


@dataclass
class _Segment:
    text_lo: int
    text_hi: int
    sa_lo: int
    sa_hi: int
    doc_lo: int  # index into the sealed-document table
    doc_hi: int
    bucket: np.ndarray | None = field(default=None, compare=False, repr=False)  # first-token table, lazily

    def first_token_table(self, text: np.ndarray, sa: np.ndarray) -> np.ndarray | None:
        """bucket[t] = where suffixes starting with token t begin in sa (absolute); None when the
        segment is small, or when the table would cost more than a byte per suffix (4 bytes an entry)."""
        size = self.sa_hi - self.sa_lo
        if size < BUCKET_MIN_TOKENS:
            return None
        if self.bucket is None:
            vocab = int(text[sa[self.sa_hi - 1]]) + 1  # the largest first token: the suffixes are sorted
            if 4 * (vocab + 1) > size:
                return None  # decided without reading the segment: this runs at every kernel-view rebuild
            first = text[sa[self.sa_lo : self.sa_hi]]
            counts = np.bincount(first, minlength=vocab)
            table = np.empty(vocab + 1, dtype=np.int32)
            table[0] = self.sa_lo
            np.cumsum(counts, out=table[1:])
            table[1:] += self.sa_lo
            self.bucket = table
        return self.bucket


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
        self._text = np.zeros(0, dtype=np.int32)
        self._text_len = 0
        self._sa = np.zeros(0, dtype=np.int32)
        self._sa_len = 0
        self._segments: list[_Segment] = []
        self._doc_ids: list[int] = []
        self._doc_starts: list[int] = []  # text position of each sealed document
        self._live = LiveArena()
        self._next_id = 0
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
        ids = list(range(self._next_id, self._next_id + len(parts)))
        self._next_id += len(parts)
        lengths = np.array([len(p) + 1 for p in parts], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        text = np.full(int(lengths.sum()), SEP, dtype=np.int32)
        for offset, part in zip(offsets, parts):
            text[offset : offset + len(part)] = part
        self._doc_ids += ids
        self._doc_starts += (offsets + self._text_len).tolist()
        self._append_segment(text, len(parts))
        while len(self._segments) >= 2 and self._seg_size(-1) >= self._seg_size(-2):
            self._merge_last_two()
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
        num_docs = len(self._doc_ids)
        if not 0 <= num_sequences <= num_docs:
            raise SuffixIndexError(f"head({num_sequences}): the index holds {num_docs} sealed sequences")
        cut = self._doc_starts[num_sequences] if num_sequences < num_docs else self._text_len
        out = SuffixIndex(self.max_depth, self.vocab_size, self.budget_bytes)
        out._text, out._text_len = self._text[:cut], cut
        blocks, at = [], 0
        for seg in self._segments:
            if seg.doc_lo >= num_sequences:
                break
            block = self._sa[seg.sa_lo : seg.sa_hi]
            if seg.doc_hi > num_sequences:
                block = block[block < cut]
            out._segments.append(_Segment(seg.text_lo, min(seg.text_hi, cut), at, at + len(block), seg.doc_lo,
                                          min(seg.doc_hi, num_sequences)))
            blocks.append(block)
            at += len(block)
        out._sa = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int32)
        out._sa_len = at
        out._doc_ids, out._doc_starts = self._doc_ids[:num_sequences], self._doc_starts[:num_sequences]
        out._next_id = self._next_id
        return out

    def start(self, tokens: Sequence[int] = ()) -> int:
        """Start a live sequence (e.g. a request's prompt); returns its id."""
        arr = check_tokens(tokens, self.vocab_size)
        seq_id = self._next_id
        self._next_id += 1
        self._live.start(seq_id, arr, self.max_depth)
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
        arena = self._live.tok
        self._live.extend(seq_id, arr, self.max_depth)
        if self._live.tok is not arena or self._kernel_args is None:
            self._kernel_args = None
        else:
            self._sync_live_args()

    def hot_args(self, seq_id: int, room: int = 0) -> tuple[tuple, int, int]:
        """For a kernel that appends in place (core.engine_step): the kernels' view of the index
        (kernel_view) with room for `room` more tokens in live sequence `seq_id`, that sequence's slot
        in the view's live arrays, and the tokens its region holds before it must move. Tell the index
        with `appended` what the kernel appended."""
        self._get_live(seq_id)
        arena, cap = self._live.tok, self._live.regions[seq_id][1]
        region = self._live.reserve(seq_id, room)
        if self._live.tok is not arena:
            self._kernel_args = None
        elif self._kernel_args is not None and region[1] != cap:
            self._sync_live_args()  # the region moved (and a compaction moves others)
        return self._args(), self._slots[seq_id], region[1]

    def kernel_view(self) -> tuple:
        """The kernels' view of the index (arrays; the same object until the index's layout changes)."""
        return self._args()

    def appended(self, seq_id: int, num: int) -> None:
        """A kernel appended `num` tokens to live sequence `seq_id` through hot_args' view (its
        lengths array is up to date already)."""
        self._live.regions[seq_id][2] += num

    def live_tokens(self, seq_id: int) -> np.ndarray:
        """A live sequence's tokens so far (a view: valid until the next append)."""
        self._get_live(seq_id)
        return self._live.tokens(seq_id)

    def finish(self, seq_id: int) -> int:
        """Seal a live sequence as a finished one (it keeps its id); returns the id."""
        self._get_live(seq_id)
        tokens = self._live.tokens(seq_id)
        self._doc_ids.append(seq_id)
        self._doc_starts.append(self._text_len)
        text = np.empty(len(tokens) + 1, dtype=np.int32)
        text[:-1] = tokens
        text[-1] = SEP
        self._live.remove(seq_id)
        self._kernel_args = None
        self._append_segment(text, 1)
        while len(self._segments) >= 2 and self._seg_size(-1) >= self._seg_size(-2):
            self._merge_last_two()
        self._enforce_budget()
        return seq_id

    def discard(self, seq_id: int) -> None:
        """Drop a live sequence without keeping it."""
        self._get_live(seq_id)
        self._live.remove(seq_id)
        self._kernel_args = None

    def compact(self) -> None:
        """Merge all sealed segments into one (fastest queries; one full sort)."""
        while len(self._segments) >= 2:
            self._merge_last_two()

    def evict(self, budget_bytes: int) -> int:
        """Drop the oldest sealed sequences until nbytes <= budget_bytes; returns how many were dropped."""
        if budget_bytes < 0:
            raise SuffixIndexError(f"budget_bytes must be >= 0, got {budget_bytes}")
        num_docs = len(self._doc_ids)
        drop = 0
        # Bytes the remaining sequences will need once compacted: 4 (text) + 4 (sa) per token,
        # 4 for each separator, 16 per document-table entry, plus live sequences, plus today's
        # first-token tables (dropping sequences never makes a table larger).
        fixed = self._live_bytes() + self._table_bytes()
        doc_bytes = [0] * num_docs
        for i in range(num_docs):
            end = self._doc_starts[i + 1] if i + 1 < num_docs else self._text_len
            length = end - self._doc_starts[i] - 1
            doc_bytes[i] = 8 * length + 4 + 16
        remaining = sum(doc_bytes)
        while drop < num_docs and fixed + remaining > budget_bytes:
            remaining -= doc_bytes[drop]
            drop += 1
        if drop or self.nbytes > budget_bytes:
            self._drop_oldest(drop)  # also trims spare capacity
        return drop

    # ----------------------------------------------------------------- queries

    @property
    def num_sequences(self) -> int:
        return len(self._doc_ids) + len(self._live.regions)

    @property
    def num_tokens(self) -> int:
        return self._sa_len + sum(r[2] for r in self._live.regions.values())

    @property
    def nbytes(self) -> int:
        """Resident bytes of the index arrays (capacity, not just the used part)."""
        return self._text.nbytes + self._sa.nbytes + self._table_bytes() + 16 * len(self._doc_ids) + self._live_bytes()

    def _table_bytes(self) -> int:
        tables = (s.first_token_table(self._text, self._sa) for s in self._segments)
        return sum(t.nbytes for t in tables if t is not None)


    def sequences(self) -> Iterator[tuple[int, np.ndarray]]:
        """(id, tokens) of every sequence, sealed ones oldest first, then live ones."""
        for i, seq_id in enumerate(self._doc_ids):
            lo = self._doc_starts[i]
            hi = self._doc_starts[i + 1] - 1 if i + 1 < len(self._doc_ids) else self._text_len - 1
            yield seq_id, self._text[lo:hi]
        for seq_id in self._live.regions:
            yield seq_id, self._live.tokens(seq_id)

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
                  min_token_prob: float = 0.1, tree: bool = True,
                  floor: tuple[float, int] = (0.0, 0), checked: bool = False) -> Draft | None:
        """Best draft for `context` from this index alone, or None if none beats `floor` (score, match_len).
        `checked`: `context` came from check_tokens and the other arguments passed check_speculate_args."""
        if checked:
            return self._speculate(context, max_spec_tokens, max_spec_factor, min_token_prob, tree, floor)  # type: ignore[arg-type]
        ctx = check_tokens(context, self.vocab_size, "context")
        check_speculate_args(ctx, max_spec_tokens, max_spec_factor, min_token_prob, self.max_depth)
        return self._speculate(ctx, max_spec_tokens, max_spec_factor, min_token_prob, tree, floor)

    def _speculate(self, ctx: np.ndarray, max_spec_tokens: int, max_spec_factor: float, min_token_prob: float,
                   tree: bool, floor: tuple[float, int]) -> Draft | None:
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
        return self._text[: self._text_len]

    def to_bytes(self, include_text: bool = True) -> bytes:
        """Flat serialisation (see index_format.dump); without the text, the compact form."""
        return index_format.dump(self, include_text)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, text: np.ndarray | None = None) -> "SuffixIndex":
        """Load without re-sorting (see index_format.load); `text` when it was left out."""
        return index_format.load(cls, data, text)

    # ----------------------------------------------------------------- internals

    def _get_live(self, seq_id: int) -> None:
        if seq_id not in self._live.regions:
            raise SuffixIndexError(f"no live sequence with id {seq_id}")

    def _live_bytes(self) -> int:
        return self._live.nbytes()

    def _seg_size(self, k: int) -> int:
        s = self._segments[k]
        return s.sa_hi - s.sa_lo

    def _writable(self) -> None:
        # Loaded arrays are read-only views of the serialised bytes; copy before the first write.
        if not self._text.flags.writeable:
            self._text = self._text.copy()
        if not self._sa.flags.writeable:
            self._sa = self._sa.copy()

    def _append_segment(self, text: np.ndarray, num_docs: int) -> None:
        self._writable()
        t0 = self._text_len
        sa = build_suffix_array(text)
        self._text = _reserve(self._text, t0 + len(text))
        self._text[t0 : t0 + len(text)] = text
        self._text_len += len(text)
        s0 = self._sa_len
        self._sa = _reserve(self._sa, s0 + len(sa))
        self._sa[s0 : s0 + len(sa)] = sa + t0
        self._sa_len += len(sa)
        doc_hi = len(self._doc_ids)
        self._segments.append(_Segment(t0, self._text_len, s0, self._sa_len, doc_hi - num_docs, doc_hi))
        self._kernel_args = None

    def _merge_last_two(self) -> None:
        a, b = self._segments[-2], self._segments[-1]
        self._rebuild(_Segment(a.text_lo, b.text_hi, a.sa_lo, b.sa_hi, a.doc_lo, b.doc_hi))
        self._segments[-2:] = [_Segment(a.text_lo, b.text_hi, a.sa_lo, b.sa_hi, a.doc_lo, b.doc_hi)]

    def _rebuild(self, seg: _Segment) -> None:
        self._writable()
        sa = build_suffix_array(self._text[seg.text_lo : seg.text_hi])
        self._sa[seg.sa_lo : seg.sa_hi] = sa + seg.text_lo
        self._kernel_args = None

    def _enforce_budget(self) -> None:
        if self.budget_bytes is not None and self.nbytes > self.budget_bytes:
            self.evict(self.budget_bytes)

    def _drop_oldest(self, drop: int) -> None:
        """Remove the `drop` oldest sealed documents and compact the arrays."""
        num_docs = len(self._doc_ids)
        cut = self._doc_starts[drop] if drop < num_docs else self._text_len
        text = self._text[cut : self._text_len].copy()
        keep = self._sa[: self._sa_len] >= cut
        sa = self._sa[: self._sa_len][keep] - cut  # segment blocks stay contiguous and in order
        segments = []
        for s in self._segments:
            if s.doc_hi <= drop:
                continue
            segments.append(s)
        self._doc_ids = self._doc_ids[drop:]
        self._doc_starts = [p - cut for p in self._doc_starts[drop:]]
        self._text, self._text_len = text, len(text)
        self._sa, self._sa_len = sa.astype(np.int32), len(sa)
        # Recompute block bounds; a partly dropped segment is still sorted (a subsequence of a
        # sorted block stays sorted), so nothing needs re-sorting.
        new_segments = []
        sa_pos = 0
        for s in segments:
            d_lo = max(s.doc_lo - drop, 0)
            d_hi = s.doc_hi - drop
            t_lo = self._doc_starts[d_lo]
            t_hi = self._doc_starts[d_hi] if d_hi < len(self._doc_ids) else self._text_len
            size = (t_hi - t_lo) - (d_hi - d_lo)
            new_segments.append(_Segment(t_lo, t_hi, sa_pos, sa_pos + size, d_lo, d_hi))
            sa_pos += size
        self._segments = new_segments
        self._kernel_args = None

    def _args(self) -> tuple:
        """The kernels' view of the index: text, sa, segment bounds, live arenas, bases, lengths."""
        if self._kernel_args is None:
            self._slots = {seq_id: k for k, seq_id in enumerate(self._live.regions)}
            regions = list(self._live.regions.values())
            tables = [s.first_token_table(self._text, self._sa) for s in self._segments]
            offsets, vocabs, parts, at = [], [], [], 0
            for table in tables:
                offsets.append(at if table is not None else -1)
                vocabs.append(len(table) - 1 if table is not None else 0)
                if table is not None:
                    parts.append(table)
                    at += len(table)
            self._kernel_args = (
                self._text, self._sa,
                np.array([s.sa_lo for s in self._segments], dtype=np.int64),
                np.array([s.sa_hi for s in self._segments], dtype=np.int64),
                np.array(offsets, dtype=np.int64), np.array(vocabs, dtype=np.int64),
                np.concatenate(parts) if parts else np.zeros(1, dtype=np.int32),
                self._live.tok, self._live.pa,
                np.array([r[0] for r in regions], dtype=np.int64),
                np.array([r[2] for r in regions], dtype=np.int64),
            )
        return self._kernel_args

    def _sync_live_args(self) -> None:
        # Appends change live lengths (and, after a move, bases) in place; arenas stay the same objects.
        bases, lens = self._kernel_args[-2:]
        for k, (base, _, n) in enumerate(self._live.regions.values()):
            bases[k] = base
            lens[k] = n

    def _check_pattern(self, pattern: Sequence[int]) -> np.ndarray:
        pat = check_tokens(pattern, self.vocab_size, "pattern")
        if len(pat) > self.max_depth:
            raise SuffixIndexError(f"pattern has {len(pat)} tokens; this index answers up to max_depth={self.max_depth}")
        return pat

    def _node(self, pattern: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """A pattern's node: sealed ranges, live occurrence starts, total count."""
        pat = self._check_pattern(pattern)
        text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, live_tok, live_pa, live_base, live_len = self._args()
        flo, fhi, total = _forward_ranges(text, sa, seg_lo, seg_hi, seg_bucket, seg_vocab, buckets, pat)
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


def _reserve(arr: np.ndarray, n: int) -> np.ndarray:
    """`arr` with room for n items (doubling), contents kept."""
    if n <= len(arr):
        return arr
    out = np.empty(max(n, 2 * len(arr), 1024 if len(arr) else 0), dtype=arr.dtype)
    out[: len(arr)] = arr
    return out
