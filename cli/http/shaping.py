"""Stream shaping: what a client sees on the wire does not depend on which drafts were accepted.

Unshaped, `specx serve` streams one event per verification step holding the step's accepted
tokens, as soon as the step ends: the number of tokens per event and the time between events say
how much of each step the drafts got right, and the drafts come from stored history (the side
channel of "When Speculation Spills Secrets", docs/security.md). Shaped, each event holds one
token's text, and every token takes one slot of a steady clock, whether its text leaves then or is
held to leave with a later one (a tool call, a stop string's prefix, a character's first bytes):
slots about a plain step's mean time apart, spreading as sqrt(k) (core/serve/pace.py, cli/live.py),
never two at once after a stall; the decoding keeps the same clock and drafts only where it is
ahead of it. A non-streamed answer is held until the same clock would have sent its last token.
The output is the same; the latency about plain decoding's (speculation still saves the server
its passes).

>>> split_tokens("Hello world!", [1, 2, 3], lambda ids: ["Hello", " world", "!"][: len(ids)] and
...              "".join(["Hello", " world", "!"][: len(ids)]))
['Hello', ' world', '!']
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ..core.serve.pace import Clock

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


class Pacer(Clock):
    """The wire's side of a shaped stream's clock (core.serve.pace.Clock): the event ready now
    waits for its token's slot."""

    async def wait(self) -> None:
        wait = self.delay(asyncio.get_running_loop().time())
        if wait > 0:
            await asyncio.sleep(wait)
