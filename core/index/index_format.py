"""The serialised form of a SuffixIndex: a JSON header, then its raw arrays, 8-byte aligned.

Loading maps the arrays (np.frombuffer): nothing is re-sorted. The compact form leaves the text
out (the caller keeps the sequences) and stores the suffix array as Psi deltas in byte planes,
which compress several times better; loading it walks the text once (psi_decode).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
from numba import njit

from ..numba_cache import configure as configure_numba_cache
from .sealed import Sealed, Segment
from .suffix_array import SEP
from .tokens import SuffixIndexError

configure_numba_cache()  # before the kernels here are decorated

MAGIC = b"SPECXIDX"
FORMAT_VERSION = 1


def dump(index: Any, include_text: bool = True) -> bytes:
    """A SuffixIndex, flat (typed `Any`: the index imports this module, not the other way): a JSON
    header, then the raw arrays (8-byte aligned).

    Without the text (the sealed sequences), the bytes hold only what sorting produced, and in
    a compact form: the suffix array as Psi deltas, byte-planes split (see psi_encode), which
    compress several times better. A caller that keeps the sequences elsewhere passes them
    back to from_bytes, which recovers the suffix array by one walk along the text.
    """
    sealed, live = index.sealed, index.live
    live_ids = list(live.regions)
    psi_starts: list[int] = []
    if include_text:
        sa_array = sealed.sa[: sealed.sa_len]
    else:
        deltas = np.empty(sealed.sa_len, dtype="<i4")
        for seg in sealed.segments:
            psi_starts.append(int(psi_encode(sealed.text, sealed.sa[seg.sa_lo : seg.sa_hi], seg.text_lo,
                                             seg.text_hi, deltas[seg.sa_lo : seg.sa_hi])))
        sa_array = deltas.view(np.uint8).reshape(-1, 4).T.copy().reshape(-1)  # byte planes
    arrays = {
        "text": sealed.text[: sealed.text_len] if include_text else sealed.text[:0],
        "sa": sa_array,
        "doc_ids": np.asarray(sealed.doc_ids, dtype=np.int64),
        "doc_starts": np.asarray(sealed.doc_starts, dtype=np.int64),
        "segments": np.asarray([[s.text_lo, s.text_hi, s.sa_lo, s.sa_hi, s.doc_lo, s.doc_hi]
                                for s in sealed.segments], dtype=np.int64).reshape(-1, 6),
    }
    for k, seq_id in enumerate(live_ids):
        base, _, n = live.regions[seq_id]
        arrays[f"live{k}.tokens"] = live.tok[base : base + n]
        arrays[f"live{k}.pa"] = live.pa[base : base + n]
    layout = {}
    offset = 0
    for name, arr in arrays.items():
        layout[name] = [str(arr.dtype), list(arr.shape), offset]
        offset += (arr.nbytes + 7) // 8 * 8
    header = json.dumps({
        "text_len": sealed.text_len,
        "psi_starts": None if include_text else psi_starts,
        "max_depth": index.max_depth, "vocab_size": index.vocab_size, "budget_bytes": index.budget_bytes,
        "next_id": index.next_id, "live_ids": live_ids, "arrays": layout,
    }).encode()
    header += b" " * (-(len(header) + 20) % 8)
    out = bytearray(MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header)
    for arr in arrays.values():
        out += arr.tobytes()
        out += b"\0" * (-arr.nbytes % 8)
    return bytes(out)


def load(cls: type, data: bytes | memoryview, text: np.ndarray | None = None) -> Any:
    """An index of class `cls` (SuffixIndex) from `dump`'s bytes, without re-sorting: the arrays
    are views of `data` until written.

    `text` supplies the sealed sequences (as `text()` returned them) when they were left out.
    """
    buf = memoryview(data)
    if bytes(buf[:8]) != MAGIC:
        raise SuffixIndexError("not a specx index (bad magic bytes)")
    version, header_len = struct.unpack("<IQ", buf[8:20])
    if version != FORMAT_VERSION:
        raise SuffixIndexError(f"index format version {version} is not supported (expected {FORMAT_VERSION})")
    try:
        header = json.loads(bytes(buf[20 : 20 + header_len]))
    except ValueError as exc:
        raise SuffixIndexError(f"corrupt index header: {exc}") from None
    base = 20 + header_len
    arrays = {}
    for name, (dtype, shape, offset) in header["arrays"].items():
        count = int(np.prod(shape)) if shape else 1
        start = base + offset
        nbytes = count * np.dtype(dtype).itemsize
        if start + nbytes > len(buf):
            raise SuffixIndexError(f"truncated index: array {name!r} runs past the end")
        arrays[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(shape)
    index = cls(header["max_depth"], header["vocab_size"], header["budget_bytes"])
    if text is not None:
        if len(text) != header["text_len"]:
            raise SuffixIndexError(f"the text given has {len(text)} tokens; the index needs {header['text_len']}")
        arrays["text"] = np.ascontiguousarray(text, dtype=np.int32)
    elif len(arrays["text"]) != header["text_len"]:
        raise SuffixIndexError("this index was saved without its text: pass text= to from_bytes")
    text = arrays["text"]
    segments = [Segment(*map(int, row)) for row in arrays["segments"]]
    if header.get("psi_starts") is None:
        sa = arrays["sa"]
    else:
        planes = arrays["sa"]
        if len(planes) % 4:
            raise SuffixIndexError("corrupt index: compact suffix array is not whole int32 values")
        deltas = planes.reshape(4, -1).T.copy().reshape(-1).view("<i4")
        sa = np.empty(len(deltas), dtype=np.int32)
        for seg, start in zip(segments, header["psi_starts"]):
            psi_decode(text, deltas[seg.sa_lo : seg.sa_hi], seg.text_lo, seg.text_hi, start, sa[seg.sa_lo : seg.sa_hi])
    index.sealed = Sealed(text, sa, segments, arrays["doc_ids"].tolist(), arrays["doc_starts"].tolist())
    index.next_id = header["next_id"]
    for k, seq_id in enumerate(header["live_ids"]):
        index.live.restore(seq_id, arrays[f"live{k}.tokens"], arrays[f"live{k}.pa"])
    return index


# Compact storage of a suffix array: Psi[r] = rank of the suffix that follows suffix SA[r] in the
# text (skipping separators). Within the suffixes that start with the same token Psi increases,
# so its deltas are small numbers that compress several times better than SA itself, and SA
# comes back from Psi and the text by one walk along the text: no sorting.


@njit(cache=True, nogil=True)
def psi_encode(text: np.ndarray, sa: np.ndarray, text_lo: int, text_hi: int, out: np.ndarray) -> int:
    """Psi deltas of one segment's block `sa` (positions in text[text_lo:text_hi]) into `out`.

    Returns the rank of the segment's first real position (-1 when it has none).
    """
    rank = np.full(text_hi - text_lo, -1, dtype=np.int64)
    for r in range(len(sa)):
        rank[sa[r] - text_lo] = r
    prev = 0
    for r in range(len(sa)):
        p = sa[r] + 1
        while p < text_hi and text[p] == SEP:
            p += 1
        psi = rank[p - text_lo] if p < text_hi else -1
        out[r] = psi - prev
        prev = psi
    for p in range(text_lo, text_hi):
        if text[p] != SEP:
            return rank[p - text_lo]
    return -1


@njit(cache=True, nogil=True)
def psi_decode(text: np.ndarray, deltas: np.ndarray, text_lo: int, text_hi: int, start: int, out: np.ndarray) -> None:
    """The inverse of psi_encode: one segment's suffix array block into `out`."""
    psi = np.empty(len(deltas), dtype=np.int64)
    acc = 0
    for r in range(len(deltas)):
        acc += deltas[r]
        psi[r] = acc
    r = start
    for p in range(text_lo, text_hi):
        if text[p] != SEP:
            out[r] = p
            r = psi[r]
