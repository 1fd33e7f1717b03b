"""Tokens -> text while decoding: incremental detokenization and stop strings.

A TextStream is fed each step's tokens and says where a stop string ends, so generation can stop
on the exact token that completed it; the text it hands out never contains a stop string, and is
held back while its end could still become one (or is half of a multi-byte character).

    settings = Decoding(max_new_tokens=64, stop=["\\n\\n"])   # core.decode.request
    stream = TextStream(tokenizer, stop=settings.stop)
    for step in generate(model, prompt, drafter, settings, stop=stream):
        print(stream.pop(), end="")
    print(stream.pop(final=True))
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any


class TextStream:
    """Incremental detokenization with stop strings (OpenAI semantics: the text ends before the
    first stop string, which is not part of it).

    Call it with each step's new tokens: it returns None to go on, or how many of those tokens to
    keep when a stop string ended among them (tokens after that one are dropped). `text` is the
    text so far, cut before the stop string; `pop()` returns the part not yet handed out that is
    safe to show.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] | str | None = None, skip_special_tokens: bool = True) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = stops
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.stopped_by: str | None = None  # the stop string that ended the text
        self._text = ""  # decoded text so far (complete characters only)
        self._prefix = 0  # tokens[_prefix:_read] decode to the tail already in _text (context for the next piece)
        self._read = 0
        self._shown = 0  # characters of text handed out by pop()

    @property
    def text(self) -> str:
        return self._text

    def __call__(self, new_tokens: Sequence[int]) -> int | None:
        if self.stopped_by is not None:
            return 0
        if not self.stop:  # no stop strings: one decode per step
            self.tokens.extend(int(t) for t in new_tokens)
            self._decode()
            return None
        for i, tok in enumerate(new_tokens):
            self.tokens.append(int(tok))
            start = max(0, len(self._text) - max(len(s) for s in self.stop) + 1)
            self._decode()
            hits = [(self._text.find(s, start), s) for s in self.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, self.stopped_by = min(hits)
                self._text = self._text[:pos]
                return i + 1
        return None

    def finish_reason(self, max_tokens: int, eos_token_ids: Collection[int] = ()) -> str:
        """OpenAI's finish_reason once decoding ended: "stop" (a stop string, or the model ended,
        one of `eos_token_ids`) or "length" (max_tokens reached)."""
        ended = self.stopped_by is not None or bool(self.tokens and self.tokens[-1] in eos_token_ids)
        return "stop" if ended or len(self.tokens) < max_tokens else "length"

    def pop(self, final: bool = False) -> str:
        """The text not yet handed out, less a tail that could still start a stop string (or the
        whole rest when `final`, or once stopped)."""
        if final and self.stopped_by is None and self._read < len(self.tokens):
            self._decode(force=True)  # an incomplete character at the very end, as the tokenizer shows it
        end = len(self._text)
        if not final and self.stopped_by is None:
            end -= self._held_back()
        piece = self._text[self._shown : end] if end > self._shown else ""
        self._shown = max(self._shown, end)
        return piece

    def _held_back(self) -> int:
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _decode(self, force: bool = False) -> None:
        # Decode a few tokens of context plus the new ones, and take what they add; a piece that
        # ends in an incomplete character waits for the next token (the usual incremental scheme),
        # unless `force`d at the end.
        decode = self.tokenizer.decode
        before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.tokens[self._prefix :], skip_special_tokens=self.skip_special_tokens)
        if force or (len(after) > len(before) and not after.endswith("\ufffd")):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
