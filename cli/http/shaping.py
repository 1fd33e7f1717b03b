"""Stream shaping: what a client sees on the wire does not depend on which drafts were accepted.

Unshaped, `specx serve` streams one event per verification step holding the step's accepted
tokens, as soon as the step ends: the number of tokens per event and the time between events say
how much of each step the drafts got right, and the drafts come from stored history (the side
channel of "When Speculation Spills Secrets", docs/security.md). Shaped, each event holds one
token's text, and every token takes one slot of a steady clock, whether its text leaves then or is
held to leave with a later one (a tool call, a stop string's prefix, a character's first bytes):
one slot every `interval` seconds (by default the
learned cost of a one-token pass, the pace of plain decoding), never two at once after a stall.
A non-streamed answer is held until the same clock would have sent its last token. The output is
the same; the latency is plain decoding's (speculation still saves the server its passes).

>>> split_tokens("Hello world!", [1, 2, 3], lambda ids: ["Hello", " world", "!"][: len(ids)] and
...              "".join(["Hello", " world", "!"][: len(ids)]))
['Hello', ' world', '!']
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

PAD_BYTES = 256  # a shaped stream's events are padded to a multiple of this (their size says nothing)


def split_tokens(text: str, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """`text` (what a step's `tokens` wrote) cut into one piece per token, at the lengths decoding
    a growing prefix of `tokens` gives (clipped to `text`: held or stopped text shifts them). The
    pieces join to `text`; a token that completes no character gets an empty piece."""
    if len(tokens) <= 1:
        return [text]
    cuts, last = [], 0
    for i in range(1, len(tokens)):
        last = min(len(text), max(last, len(decode(list(tokens[:i])))))
        cuts.append(last)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def pad(event: bytes, size: int = PAD_BYTES) -> bytes:
    """An SSE event padded to a multiple of `size` bytes with a comment line (clients skip those),
    so that its length does not tell how long the token's text is.

    >>> [len(pad(b"data: {}\\n\\n", 64)), len(pad(b"data: " + b"x" * 60 + b"\\n\\n", 64))]
    [64, 128]
    """
    room = -(len(event) + 2) % size  # b":" + spaces + b"\n" before the event
    return b":" + b" " * room + b"\n" + event


class Pacer:
    """Releases one event per `interval` seconds: event k at max(its slot, the time it is ready);
    after a late event the clock goes on from it (no catching up in a burst)."""

    def __init__(self, interval: float) -> None:
        self.interval = max(0.0, float(interval))
        self.next: float | None = None

    def delay(self, now: float) -> float:
        """Seconds to wait before the event ready at `now` may leave (and book the next slot)."""
        slot = now if self.next is None else max(self.next, now)
        self.next = slot + self.interval
        return slot - now

    async def wait(self) -> None:
        wait = self.delay(asyncio.get_running_loop().time())
        if wait > 0:
            await asyncio.sleep(wait)

    def hold_until(self, first: float, tokens: int) -> float:
        """When a non-streamed answer of `tokens` tokens, its first ready at `first`, may leave."""
        return first + max(0, tokens - 1) * self.interval
