"""The sealed part of a suffix index: finished sequences in one text and one segmented suffix array.

All sealed sequences live in one int32 text (each followed by SEP, oldest first) and one int32
suffix array made of segments, each a sorted block over a contiguous run of sequences. Adding
sequences appends a segment; the youngest segments merge when the newer has grown as large as the
one before it (a binary counter: a token is re-sorted O(log n) times and a query visits O(log n)
segments). Dropping the oldest sequences (eviction) or keeping only the oldest (`head`) filters
the blocks without sorting: a subsequence of a sorted block stays sorted, and no pattern crosses
the SEP that ends a sequence.

>>> sealed = Sealed()
>>> sealed.add([np.array([1, 2, 3], dtype=np.int32), np.array([1, 2, 4], dtype=np.int32)], [0, 1])
>>> sealed.text[: sealed.text_len].tolist(), len(sealed.segments)
([1, 2, 3, -1, 1, 2, 4, -1], 1)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .suffix_array import SEP, build_suffix_array

BUCKET_MIN_TOKENS = 4096  # smaller segments stay in cache: binary search is as fast there


@dataclass
class Segment:
    """A sorted block of the suffix array: sa[sa_lo:sa_hi] are the suffixes of text[text_lo:text_hi]
    (separators left out), which holds sealed sequences doc_lo..doc_hi-1."""

    text_lo: int
    text_hi: int
    sa_lo: int
    sa_hi: int
    doc_lo: int  # index into the sealed-document table
    doc_hi: int
    bucket: np.ndarray | None = field(default=None, compare=False, repr=False)  # first-token table, lazily

    @property
    def size(self) -> int:
        return self.sa_hi - self.sa_lo

    def first_token_table(self, text: np.ndarray, sa: np.ndarray) -> np.ndarray | None:
        """bucket[t] = where suffixes starting with token t begin in sa (absolute); None when the
        segment is small, or when the table would cost more than a byte per suffix (4 bytes an entry)."""
        if self.size < BUCKET_MIN_TOKENS:
            return None
        if self.bucket is None:
            vocab = int(text[sa[self.sa_hi - 1]]) + 1  # the largest first token: the suffixes are sorted
            if 4 * (vocab + 1) > self.size:
                return None  # decided without reading the segment: this runs at every kernel-view rebuild
            first = text[sa[self.sa_lo : self.sa_hi]]
            counts = np.bincount(first, minlength=vocab)
            table = np.empty(vocab + 1, dtype=np.int32)
            table[0] = self.sa_lo
            np.cumsum(counts, out=table[1:])
            table[1:] += self.sa_lo
            self.bucket = table
        return self.bucket


class Sealed:
    """The sealed sequences: `text[:text_len]`, `sa[:sa_len]` in `segments`, and per sequence its
    id (`doc_ids`) and where its text starts (`doc_starts`). Arrays keep spare capacity; loaded
    ones may be read-only views, copied before the first write."""

    def __init__(self, text: np.ndarray | None = None, sa: np.ndarray | None = None,
                 segments: list[Segment] | None = None, doc_ids: list[int] | None = None,
                 doc_starts: list[int] | None = None) -> None:
        self.text = text if text is not None else np.zeros(0, dtype=np.int32)
        self.text_len = len(self.text)
        self.sa = sa if sa is not None else np.zeros(0, dtype=np.int32)
        self.sa_len = len(self.sa)
        self.segments = segments or []
        self.doc_ids = doc_ids or []
        self.doc_starts = doc_starts or []

    @property
    def nbytes(self) -> int:
        """Resident bytes (capacity, not just the used part), first-token tables included."""
        return self.text.nbytes + self.sa.nbytes + self.table_bytes() + 16 * len(self.doc_ids)

    def tables(self) -> list[np.ndarray | None]:
        return [s.first_token_table(self.text, self.sa) for s in self.segments]

    def table_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables() if t is not None)

    def doc_bytes(self) -> list[int]:
        """What each sequence costs once compacted: 8 bytes a token (text and sa), 4 for its
        separator, 16 for its document-table entry."""
        ends = self.doc_starts[1:] + [self.text_len]
        return [8 * (end - start - 1) + 4 + 16 for start, end in zip(self.doc_starts, ends)]

    def sequences(self) -> Iterator[tuple[int, np.ndarray]]:
        """(id, tokens) of every sealed sequence, oldest first."""
        ends = self.doc_starts[1:] + [self.text_len]
        for seq_id, start, end in zip(self.doc_ids, self.doc_starts, ends):
            yield seq_id, self.text[start : end - 1]

    # ------------------------------------------------------------------- changes

    def add(self, parts: list[np.ndarray], ids: list[int]) -> None:
        """Seal `parts` (checked token arrays) under `ids` as one segment (one sort), then merge."""
        lengths = np.array([len(p) + 1 for p in parts], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        text = np.full(int(lengths.sum()), SEP, dtype=np.int32)
        for offset, part in zip(offsets, parts):
            text[offset : offset + len(part)] = part
        self.doc_ids += ids
        self.doc_starts += (offsets + self.text_len).tolist()
        self._writable()
        t0, s0 = self.text_len, self.sa_len
        sa = build_suffix_array(text)
        self.text = _reserve(self.text, t0 + len(text))
        self.text[t0 : t0 + len(text)] = text
        self.text_len += len(text)
        self.sa = _reserve(self.sa, s0 + len(sa))
        self.sa[s0 : s0 + len(sa)] = sa + t0
        self.sa_len += len(sa)
        self.segments.append(Segment(t0, self.text_len, s0, self.sa_len, len(self.doc_ids) - len(parts),
                                     len(self.doc_ids)))
        while len(self.segments) >= 2 and self.segments[-1].size >= self.segments[-2].size:
            self.merge_last_two()

    def merge_last_two(self) -> None:
        a, b = self.segments[-2], self.segments[-1]
        merged = Segment(a.text_lo, b.text_hi, a.sa_lo, b.sa_hi, a.doc_lo, b.doc_hi)
        self._writable()
        self.sa[merged.sa_lo : merged.sa_hi] = build_suffix_array(self.text[merged.text_lo : merged.text_hi]) \
            + merged.text_lo
        self.segments[-2:] = [merged]

    def drop_oldest(self, drop: int) -> None:
        """Remove the `drop` oldest sequences and compact the arrays (spare capacity trimmed)."""
        num_docs = len(self.doc_ids)
        cut = self.doc_starts[drop] if drop < num_docs else self.text_len
        text = self.text[cut : self.text_len].copy()
        keep = self.sa[: self.sa_len] >= cut
        sa = (self.sa[: self.sa_len][keep] - cut).astype(np.int32)  # blocks stay contiguous and in order
        segments = [s for s in self.segments if s.doc_hi > drop]
        self.doc_ids = self.doc_ids[drop:]
        self.doc_starts = [p - cut for p in self.doc_starts[drop:]]
        self.text, self.text_len = text, len(text)
        self.sa, self.sa_len = sa, len(sa)
        # A partly dropped segment is still sorted (a subsequence of a sorted block): new bounds only.
        self.segments, sa_pos = [], 0
        for s in segments:
            d_lo, d_hi = max(s.doc_lo - drop, 0), s.doc_hi - drop
            t_lo = self.doc_starts[d_lo]
            t_hi = self.doc_starts[d_hi] if d_hi < len(self.doc_ids) else self.text_len
            size = (t_hi - t_lo) - (d_hi - d_lo)
            self.segments.append(Segment(t_lo, t_hi, sa_pos, sa_pos + size, d_lo, d_hi))
            sa_pos += size

    def head(self, num: int) -> Sealed:
        """The oldest `num` sequences: each block filtered to the suffixes that start in them (no
        sort). The text is shared: appends to either reallocate (its capacity is its length), never
        overwrite."""
        cut = self.doc_starts[num] if num < len(self.doc_ids) else self.text_len
        segments, blocks, at = [], [], 0
        for seg in self.segments:
            if seg.doc_lo >= num:
                break
            block = self.sa[seg.sa_lo : seg.sa_hi]
            if seg.doc_hi > num:
                block = block[block < cut]
            segments.append(Segment(seg.text_lo, min(seg.text_hi, cut), at, at + len(block), seg.doc_lo,
                                    min(seg.doc_hi, num)))
            blocks.append(block)
            at += len(block)
        sa = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int32)
        return Sealed(self.text[:cut], sa, segments, self.doc_ids[:num], self.doc_starts[:num])

    def _writable(self) -> None:
        # Loaded arrays are read-only views of the serialised bytes; copy before the first write.
        if not self.text.flags.writeable:
            self.text = self.text.copy()
        if not self.sa.flags.writeable:
            self.sa = self.sa.copy()


def _reserve(arr: np.ndarray, n: int) -> np.ndarray:
    """`arr` with room for n items (doubling), contents kept."""
    if n <= len(arr):
        return arr
    out = np.empty(max(n, 2 * len(arr), 1024 if len(arr) else 0), dtype=arr.dtype)
    out[: len(arr)] = arr
    return out
