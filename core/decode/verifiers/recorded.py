"""A recorded output as the decode loop's verifier: the simulated verifier of model-free replay
(core.predict.replay)."""

from __future__ import annotations

from ...draft import Draft
from ..loop import Verdict


class ReplayMismatch(RuntimeError):
    """The replay did not rebuild a recorded output: a bug in drafting or acceptance, never the data."""


class RecordedVerifier:
    """The simulated verifier: the recorded output is what the model writes. A draft is accepted
    along the longest path equal to the recording (the one accept walk, Draft.walk, as the model's
    greedy verifier accepts), then the recording's next token is the bonus token."""

    vocab_size = None  # drafts are not checked against a vocabulary (they are the drafters' own)
    linear = False  # it walks trees

    def __init__(self, output: list[int]) -> None:
        self.output = output
        self.pos = 0

    @property
    def finished(self) -> bool:
        return self.pos >= len(self.output)

    def start(self, prompt: list[int]) -> None:
        self.pos = 0

    def verify(self, draft: Draft) -> Verdict:
        out, pos = self.output, self.pos
        nodes = draft.accepted_nodes(out[pos : pos + len(draft)])
        path = [draft.token_ids[i] for i in nodes]
        if path != out[pos : pos + len(path)]:
            first = pos + next(i for i, (a, b) in enumerate(zip(path, out[pos:] + [None] * len(path))) if a != b)
            raise ReplayMismatch(f"replay rebuilt a different output (first difference at token {first})")
        tokens = path + out[pos + len(path) : pos + len(path) + 1]  # + the bonus token, if the output goes on
        self.pos += len(tokens)
        return Verdict(tokens, nodes)
