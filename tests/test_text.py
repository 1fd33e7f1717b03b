"""TextStream: incremental detokenization and stop strings."""

import random

import pytest

from specx.core.decode.text import TextStream


class CharTokenizer:
    """Token t is the character chr(t); token 0 is a special token (EOS)."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(t) for t in tokens if not (skip_special_tokens and t == 0))


def feed(stream, text, chunk):
    tokens = [ord(c) for c in text]
    shown, kept = "", []
    for i in range(0, len(tokens), chunk):
        step = tokens[i : i + chunk]
        keep = stream(step)
        kept += step if keep is None else step[:keep]
        shown += stream.pop()
        if keep is not None:
            break
    return shown + stream.pop(final=True), kept


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 100])
def test_text_ends_before_the_first_stop_string_on_the_token_that_completed_it(chunk):
    stream = TextStream(CharTokenizer(), stop=["END", "\n\n"])
    shown, kept = feed(stream, "SELECT 1;\n\nSELECT 2; END", chunk)
    assert shown == stream.text == "SELECT 1;"
    assert stream.stopped_by == "\n\n" and stream.finish_reason(max_tokens=11) == "stop"
    assert "".join(map(chr, kept)) == "SELECT 1;\n\n"


def test_no_stop_string_gives_all_text_and_tokens():
    stream = TextStream(CharTokenizer(), stop="zzz")
    shown, kept = feed(stream, "abc zz abc", 3)
    assert shown == "abc zz abc" and len(kept) == 10 and stream.stopped_by is None
    assert stream.finish_reason(max_tokens=10) == "length" and stream.finish_reason(max_tokens=11) == "stop"
    assert stream.finish_reason(max_tokens=10, eos_token_ids=[ord("c")]) == "stop"  # the last token was EOS


def test_a_possible_stop_prefix_is_held_back_until_decided():
    stream = TextStream(CharTokenizer(), stop=["</sql>"])
    assert stream([ord(c) for c in "x </s"]) is None
    assert stream.pop() == "x "  # "</s" could still become "</sql>"
    assert stream([ord(c) for c in "pan>"]) is None
    assert stream.pop() == "</span>"


def test_random_texts_match_a_direct_search():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        stream = TextStream(CharTokenizer(), stop=stops)
        shown, kept = feed(stream, text, rng.randint(1, 5))
        # Decoding stops on the token where a stop string is first complete; the text ends before
        # the earliest-starting stop string complete by then.
        found = [(text.find(s) + len(s), text.find(s)) for s in stops if text.find(s) >= 0]
        end = min(e for e, _ in found) if found else len(text)
        cut = min((p for e, p in found if e == end), default=len(text))
        assert shown == text[:cut], (text, stops)
        assert len(kept) == end, (text, stops)


def test_multibyte_characters_are_never_split():
    from specx.core.model.load import load_tokenizer

    tok = load_tokenizer()
    text = "naïve café — 数据库 ✓ 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok)
    pieces = []
    for t in ids:
        stream([t])
        pieces.append(stream.pop())
    pieces.append(stream.pop(final=True))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        TextStream(CharTokenizer(), stop=[""])
