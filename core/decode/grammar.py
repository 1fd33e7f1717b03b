"""Constrained decoding: a grammar (a JSON schema, a Lark grammar) decides which tokens may come
next, at every position a draft tree verifies, with llguidance's matcher.

One pass verifies a tree, so the grammar must be walked along the tree too: `Constraint.prune`
visits the draft depth first (consume a node's token, compute the mask after it, roll back to
the next sibling), drops every node whose token the grammar refuses after its parent (with its
subtree: the verifier would reject it anyway) and keeps one mask per row the accept walk reads
(the root's and each kept node's). `core.decode.verify` sets the refused tokens of each row to -inf
before it chooses, so a speculative step chooses exactly what constrained plain decoding chooses
after the same path: lossless under the grammar (tests/test_grammar.py checks it token for token).
Every row the accept walk can read allows a token: the row after an EOS node allows EOS alone (the
grammar has ended there), for a row that allows nothing has no distribution to sample from, and
the sampler then returned a token outside every mask (issue 59).

Tokens the grammar forces (the rest of a key, `": "`, a closing brace) are drafts that need no
index: `forced` gives llguidance's fast-forward tokens from the current state and core.decode.loop puts
them first in the draft, tagged GRAMMAR. They are still verified: the model may choose another
tokenization of the same bytes, which the grammar also allows.

Why llguidance (measured on the built-in model's 49,152-token vocabulary, a 3-field JSON schema,
40 tokens): mask 39 us per token on average, compile 1.3 ms; xgrammar 7 us and 5 ms, but it
installs triton (1 GB) and tvm-ffi besides; outlines-core needs the vocabulary rebuilt from
byte-level tokens and indexes a schema ahead (seconds). A mask costs ~0.1% of a forward pass of
the 135M model; llguidance needs nothing else, fast-forwards forced tokens and writes tool-call
formats as Lark grammars with JSON schemas inside (docs/serving.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..draft import Draft, subtree

MAX_FORCED = 32


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the message says where), found when it is
    checked against a vocabulary (`Vocabulary.check`, `Vocabulary.constraint`)."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of JSON text matching `schema` (None: any JSON object), compact
    (`{"a": 1, "b": [2, 3]}`: one space after ':' and ','): a small model left free to choose
    whitespace can fill its budget with newlines."""
    import llguidance

    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}),
                                                             defaults=options)
    except (ValueError, RecursionError) as exc:  # nested deeper than the compiler (or json) goes
        raise GrammarError(_short(str(exc) or type(exc).__name__)) from None


def lark_grammar(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (`%json {schema}` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class Vocabulary:
    """A tokenizer as llguidance reads it (built once per model: ~0.2 s for 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int) -> None:
        import llguidance.hf

        self.size, self.eos = int(vocab_size), int(eos)
        self.words = (self.size + 31) // 32  # int32 words of one mask row
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.size, eos_token=self.eos)

    def check(self, grammar: str) -> None:
        """GrammarError unless `grammar` compiles against this vocabulary."""
        import llguidance

        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(_short("; ".join(messages)))
        # Some grammars compile and fail at their first tokens (a regex whose automaton explodes:
        # "^(a{1000}){1000}$"): walk the tokens the grammar forces and one mask, here, not mid-answer.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if not matcher.is_error():
            for tok in list(matcher.compute_ff_tokens())[:MAX_FORCED]:
                if not matcher.consume_token(int(tok)):
                    break
            masks = np.zeros(self.words, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(masks.ctypes.data, masks.shape[0] * 4)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))

    def constraint(self, grammar: str, eos: Iterable[int] = ()) -> Constraint:
        return Constraint(self, grammar, eos)


class Constraint:
    """One decoding's grammar state. `eos`: every id that ends decoding (the grammar knows one;
    the others are allowed wherever it is)."""

    def __init__(self, vocabulary: Vocabulary, grammar: str, eos: Iterable[int] = ()) -> None:
        import llguidance

        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(_short(self.matcher.get_error()))
        self.eos = sorted({vocabulary.eos, *(int(t) for t in eos)})
        self._draft: Draft | None = None
        self._masks: np.ndarray | None = None  # [1 + N, words] int32 of the last pruned draft

    # ------------------------------------------------------------------ the state

    def advance(self, tokens: Sequence[int]) -> None:
        """Move past tokens the verifier chose (each was allowed); decoding ends at an EOS."""
        for tok in tokens:
            if tok in self.eos:
                return
            if not self.matcher.consume_token(int(tok)):
                raise GrammarError(f"token {tok} does not follow the grammar: {_short(self.matcher.get_error())}")

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (llguidance's fast-forward tokens), at most MAX_FORCED."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:MAX_FORCED]

    @property
    def done(self) -> bool:
        """Nothing but EOS may come."""
        return self.matcher.is_stopped()

    # ------------------------------------------------------------------ masks

    def _fill(self, masks: np.ndarray, row: int) -> None:
        self.matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, masks.shape[1] * 4)
        if _has(masks[row], self.vocabulary.eos) or not masks[row].any():  # EOS allowed (or nothing is: end)
            self._allow_eos(masks, row)

    def _allow_eos(self, masks: np.ndarray, row: int) -> None:
        words = masks[row].view(np.uint32)
        for tok in self.eos:
            words[tok >> 5] |= np.uint32(1 << (tok & 31))

    def _rollback(self, num_tokens: int) -> None:
        # A matcher that cannot roll back (in llguidance's error state) would leave every later mask
        # computed after tokens that were never chosen: say so here, not at a later token.
        if not self.matcher.rollback(num_tokens):
            raise GrammarError(f"the grammar's matcher could not take back {num_tokens} draft tokens: "
                               f"{_short(self.matcher.get_error())}")

    def mask(self) -> np.ndarray:
        """The allowed tokens after the current state: [words] int32, bit t of word t // 32."""
        masks = np.zeros((1, self.vocabulary.words), dtype=np.int32)
        self._fill(masks, 0)
        return masks[0]

    def prune(self, draft: Draft) -> Draft:
        """The draft without the nodes the grammar refuses (and their subtrees); keeps the masks of
        its rows for `allowed` (one pass over the tree, depth first, consume and roll back)."""
        n = len(draft)
        masks = np.zeros((1 + n, self.vocabulary.words), dtype=np.int32)
        self._fill(masks, 0)
        children: list[list[int]] = [[] for _ in range(n + 1)]  # children[0]: the roots; [1 + i]: node i's
        for i, par in enumerate(draft.parents):
            children[1 + par].append(i)
        keep = [False] * n
        stack = [(i, 0) for i in reversed(children[0])]  # (node, its depth - 1 = tokens consumed above it)
        consumed = 0
        while stack:
            i, depth = stack.pop()
            if consumed > depth:
                self._rollback(consumed - depth)
                consumed = depth
            tok = draft.token_ids[i]
            if not _has(masks[1 + draft.parents[i]], tok):
                continue
            keep[i] = True
            if tok in self.eos:  # decoding ends here: nothing after it is verified, and its row allows EOS
                self._allow_eos(masks, 1 + i)  # alone (the walk may accept it and choose once more)
                continue
            if not self.matcher.consume_token(tok):
                raise GrammarError(f"the grammar's mask allowed token {tok} but its matcher refused it: "
                                   f"{_short(self.matcher.get_error())}")
            consumed += 1
            self._fill(masks, 1 + i)
            stack.extend((c, depth + 1) for c in reversed(children[1 + i]))
        if consumed:
            self._rollback(consumed)
        pruned = draft if all(keep) else subtree(draft, keep)
        self._draft, self._masks = pruned, masks[[0] + [1 + i for i in range(n) if keep[i]]]
        return pruned

    def allowed(self, draft: Draft) -> np.ndarray:
        """Bool [1 + N, vocab]: row 0 the tokens allowed at the root, row 1 + i after node i."""
        if draft is not self._draft:
            self.prune(draft)
            if self._draft is not draft:
                raise ValueError("the draft has nodes the grammar refuses: prune it first")
        bits = np.unpackbits(self._masks.view(np.uint8), axis=1, bitorder="little")
        return bits[:, : self.vocabulary.size].astype(bool)


def _short(message: str) -> str:
    """llguidance's error without the parser state it appends (hundreds of lines of internals).

    >>> _short("lexer error: too many expressions constructed" + chr(10) + "<state>" + chr(10) + "Tokens: ...")
    'lexer error: too many expressions constructed'
    """
    return message.split("\n<state>", 1)[0].strip()[:500]


def _has(row: np.ndarray, tok: int) -> bool:
    return bool((int(row[tok >> 5]) >> (tok & 31)) & 1)

