"""Token ids as the index and the drafters take them: validated once, int32.

Token ids are non-negative and at most MAX_TOKEN (suffix sorting packs token + 2 into the high
half of an int64 key), or below a vocabulary size when one is known. Hot paths check once and
then call the unchecked internals.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .suffix_array import first_out_of_range

MAX_TOKEN = 2**31 - 3  # build_suffix_array packs (token + 2) into the high half of an int64 key


class SuffixIndexError(ValueError):
    """Bad argument to the index: the message says which and why."""


def check_tokens(tokens: Sequence[int] | np.ndarray, vocab_size: int | None, what: str = "tokens") -> np.ndarray:
    """Tokens as int32, or a ValueError naming the first bad one."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise SuffixIndexError(f"{what} must be a flat sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise SuffixIndexError(f"{what} must be integer token ids, got {arr.dtype}")
    limit = MAX_TOKEN if vocab_size is None else vocab_size - 1
    if first_out_of_range(arr, limit) >= 0:  # one compiled pass, whatever the integer type
        return _bad_token(arr, limit, what)
    return arr if arr.dtype == np.int32 else arr.astype(np.int32)


def _bad_token(arr: np.ndarray, limit: int, what: str) -> np.ndarray:
    i = int(np.flatnonzero((arr < 0) | (arr > limit))[0])
    raise SuffixIndexError(f"{what}[{i}] = {int(arr[i])} is out of range [0, {limit}]")
