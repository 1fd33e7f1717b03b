"""What the decoding tests drive the loop with: `FakeDrafter` (drafts made by a function of the
output so far and the right continuation, e.g. `all_right`, `wide_tree`; `MAKERS` holds them all),
`collect` (a generator's tokens and steps), and the JSON schema of the constrained-decoding tests."""

import random

from specx.core.decode.loop import Step
from specx.core.draft import Draft

from helpers.models import VOCAB


class FakeDrafter:
    """Returns drafts built by `make(rng, output_so_far, reference_continuation)`; records the calls
    the decode loop makes, so the tests can check the request protocol too."""

    def __init__(self, make, reference: list[int], seed: int = 0) -> None:
        self.make, self.reference, self.rng = make, reference, random.Random(seed)
        self.prompt: list[int] | None = None
        self.output: list[int] = []
        self.finished: list[bool] = []

    def start_request(self, prompt):
        self.prompt, self.output = list(prompt), []

    def extend(self, tokens):
        self.output.extend(tokens)

    def finish_request(self, learn=True):
        self.finished.append(learn)

    def speculate(self, context=None):
        return self.make(self.rng, self.output, self.reference)


def chain(tokens: list[int]) -> Draft:
    return Draft(list(tokens), list(range(-1, len(tokens) - 1)), [0.5] * len(tokens), 0.5 * len(tokens), 1)


def wrong_token(rng, right):
    return (right + rng.randrange(1, VOCAB)) % VOCAB


def all_wrong(rng, out, ref):
    return chain([wrong_token(rng, ref[len(out)]) if len(out) < len(ref) else 0] + [rng.randrange(VOCAB) for _ in range(4)])


def all_right(rng, out, ref):
    return chain(ref[len(out) : len(out) + 6])


def deep_chain(rng, out, ref):
    # right for a random stretch, then wrong: partial acceptance at every depth
    good = ref[len(out) : len(out) + rng.randrange(0, 40)]
    return chain(good + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))])


def wide_tree(rng, out, ref):
    # many roots and branches; the right path is hidden at a random place among siblings
    right = ref[len(out) : len(out) + rng.randrange(0, 8)]
    tokens, parents = [], []
    parent = -1
    for tok in right:
        for _ in range(rng.randrange(0, 4)):  # wrong siblings before and their own subtrees
            tokens.append(wrong_token(rng, tok)); parents.append(parent)
            tokens.append(rng.randrange(VOCAB)); parents.append(len(tokens) - 2)
        tokens.append(tok); parents.append(parent)
        parent = len(tokens) - 1
    for _ in range(rng.randrange(0, 5)):  # noise anywhere
        tokens.append(rng.randrange(VOCAB)); parents.append(rng.randrange(-1, len(tokens) - 1))
    return Draft(tokens, parents, [0.1] * len(tokens), 0.1 * len(tokens), 1)


def empty(rng, out, ref):
    return Draft()


MAKERS = [all_wrong, all_right, deep_chain, wide_tree, empty]


def collect(steps) -> tuple[list[int], list[Step]]:
    steps = list(steps)
    return [t for s in steps for t in s.new_tokens], steps


# the JSON the constrained-decoding tests decode under (test_grammar.py, test_quantized.py)
SCHEMA = {"type": "object", "properties": {"sql": {"type": "string"}, "tables": {"type": "array",
          "items": {"type": "string"}}, "n": {"type": "integer"}}, "required": ["sql", "tables", "n"],
          "additionalProperties": False}
