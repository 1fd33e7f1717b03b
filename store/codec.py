"""zstd compression for the store's packs and index chunks.

Each blob is one zstd frame that records its content size, so decompression allocates exactly once.
"""

from __future__ import annotations

import threading

import zstandard

MAX_BYTES = 2 << 30  # no blob of the store decompresses to more (a pack is one log file's payloads)
MAX_RATIO = 4096  # nor expands more than this over 64 MiB (logs compress ~10x; a zstd bomb ~30,000x)
LEVEL = 6  # ~3x faster to write than level 19 and within a few percent of its size on logs
_local = threading.local()  # zstd contexts are not thread-safe; one pair per thread


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_local, "pair"):
        _local.pair = (zstandard.ZstdCompressor(level=LEVEL, write_content_size=True), zstandard.ZstdDecompressor())
    return _local.pair


def compress(data: bytes) -> bytes:
    return _contexts()[0].compress(data)


class BlobError(ValueError):
    """A blob that is not a whole zstd frame of a believable size (damaged, or hostile)."""


def decompress(blob: bytes, max_bytes: int = MAX_BYTES) -> bytes:
    """The blob's bytes; BlobError if it is damaged or would expand past `max_bytes` (or MAX_RATIO)."""
    try:
        size = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as exc:
        raise BlobError(f"damaged: {exc}") from None
    if size < 0:
        raise BlobError("damaged: no content size in its frame header")
    if size > max_bytes or (size > 64 << 20 and size > MAX_RATIO * len(blob)):
        raise BlobError(f"it would expand to {size:,} bytes from {len(blob):,} (refused: a damaged or hostile block)")
    try:
        return _contexts()[1].decompress(blob)
    except zstandard.ZstdError as exc:
        raise BlobError(f"damaged: {exc}") from None
