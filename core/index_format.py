"""The serialised form of a SuffixIndex: a JSON header, then its raw arrays, 8-byte aligned.

Loading maps the arrays (np.frombuffer): nothing is re-sorted. The compact form leaves the text
out (the caller keeps the sequences) and stores the suffix array as Psi deltas in byte planes,
which compress several times better; loading it walks the text once (psi_decode).
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING

import numpy as np

from .suffix_array import psi_decode, psi_encode
from .tokens import SuffixIndexError

if TYPE_CHECKING:
    from .suffix_index import SuffixIndex

MAGIC = b"SPECXIDX"
FORMAT_VERSION = 1


def dump(index: "SuffixIndex", include_text: bool = True) -> bytes:
    """Flat serialisation: a JSON header, then the raw arrays (8-byte aligned).

    Without the text (the sealed sequences), the bytes hold only what sorting produced, and in
    a compact form: the suffix array as Psi deltas, byte-planes split (see psi_encode), which
    compress several times better. A caller that keeps the sequences elsewhere passes them
    back to from_bytes, which recovers the suffix array by one walk along the text.
    """
    live_ids = list(index._live.regions)
    psi_starts: list[int] = []
    if include_text:
        sa_array = index._sa[: index._sa_len]
    else:
        deltas = np.empty(index._sa_len, dtype="<i4")
        for seg in index._segments:
            psi_starts.append(int(psi_encode(index._text, index._sa[seg.sa_lo : seg.sa_hi], seg.text_lo,
                                             seg.text_hi, deltas[seg.sa_lo : seg.sa_hi])))
        sa_array = deltas.view(np.uint8).reshape(-1, 4).T.copy().reshape(-1)  # byte planes
    arrays = {
        "text": index._text[: index._text_len] if include_text else index._text[:0],
        "sa": sa_array,
        "doc_ids": np.asarray(index._doc_ids, dtype=np.int64),
        "doc_starts": np.asarray(index._doc_starts, dtype=np.int64),
        "segments": np.asarray([[s.text_lo, s.text_hi, s.sa_lo, s.sa_hi, s.doc_lo, s.doc_hi]
                                for s in index._segments], dtype=np.int64).reshape(-1, 6),
    }
    for k, seq_id in enumerate(live_ids):
        base, _, n = index._live.regions[seq_id]
        arrays[f"live{k}.tokens"] = index._live.tok[base : base + n]
        arrays[f"live{k}.pa"] = index._live.pa[base : base + n]
    layout = {}
    offset = 0
    for name, arr in arrays.items():
        layout[name] = [str(arr.dtype), list(arr.shape), offset]
        offset += (arr.nbytes + 7) // 8 * 8
    header = json.dumps({
        "text_len": index._text_len,
        "psi_starts": None if include_text else psi_starts,
        "max_depth": index.max_depth, "vocab_size": index.vocab_size, "budget_bytes": index.budget_bytes,
        "next_id": index._next_id, "live_ids": live_ids, "arrays": layout,
    }).encode()
    header += b" " * (-(len(header) + 20) % 8)
    out = bytearray(MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header)
    for arr in arrays.values():
        out += arr.tobytes()
        out += b"\0" * (-arr.nbytes % 8)
    return bytes(out)


def load(cls: type, data: bytes | memoryview, text: np.ndarray | None = None) -> "SuffixIndex":
    """Load from `to_bytes` output without re-sorting: the arrays are views of `data` until written.

    `text` supplies the sealed sequences (as `text()` returned them) when they were left out.
    """
    from .suffix_index import _Segment  # here: suffix_index imports this module

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
    index._text = arrays["text"]
    index._text_len = len(index._text)
    index._segments = [_Segment(*map(int, row)) for row in arrays["segments"]]
    if header.get("psi_starts") is None:
        index._sa = arrays["sa"]
    else:
        planes = arrays["sa"]
        if len(planes) % 4:
            raise SuffixIndexError("corrupt index: compact suffix array is not whole int32 values")
        deltas = planes.reshape(4, -1).T.copy().reshape(-1).view("<i4")
        index._sa = np.empty(len(deltas), dtype=np.int32)
        for seg, start in zip(index._segments, header["psi_starts"]):
            psi_decode(index._text, deltas[seg.sa_lo : seg.sa_hi], seg.text_lo, seg.text_hi, start,
                       index._sa[seg.sa_lo : seg.sa_hi])
    index._sa_len = len(index._sa)
    index._doc_ids = arrays["doc_ids"].tolist()
    index._doc_starts = arrays["doc_starts"].tolist()
    index._next_id = header["next_id"]
    for k, seq_id in enumerate(header["live_ids"]):
        tokens = arrays[f"live{k}.tokens"]
        cap = max(64, 2 * len(tokens))
        base = index._live._allocate(cap)
        index._live.tok[base : base + len(tokens)] = tokens
        index._live.pa[base : base + len(tokens)] = arrays[f"live{k}.pa"]
        index._live.regions[seq_id] = [base, cap, len(tokens)]
    return index
