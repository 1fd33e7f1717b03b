import os
from pathlib import Path

import pytest

from specx.core.model.load import warm_up_math

REPO = Path(__file__).resolve().parents[1]
AGENT_DATA = REPO.parent / "shared" / "agent-data"

# Tests build tiny models without load_model: settle torch's first-call math for them too (see there).
warm_up_math()
# The tests written for the transformers engine keep it (their references are its numerics), module
# fixtures and the servers they start included; tests/test_llamacpp.py asks for llama.cpp by name.
os.environ["SPECX_BACKEND"] = "transformers"


def specx_test_home(tmp_path_factory) -> Path:
    """The tests' SPECX_HOME: one per session (tokenizer and model caches), or SPECX_TEST_HOME."""
    return Path(os.environ.get("SPECX_TEST_HOME") or tmp_path_factory.getbasetemp() / "specx-home")


@pytest.fixture(autouse=True)
def _specx_home(tmp_path_factory, monkeypatch):
    # Never write caches into the user's home from tests; share one per session (tokenizer cache).
    monkeypatch.setenv("SPECX_HOME", str(specx_test_home(tmp_path_factory)))


@pytest.fixture(scope="session")
def builtin_tokenizer(tmp_path_factory):
    """The built-in model's tokenizer (no weights: ~1 s from the tests' cache)."""
    from specx.core.model.load import load_tokenizer

    return load_tokenizer("smollm2-135m", specx_test_home(tmp_path_factory) / "models")


@pytest.fixture(scope="session")
def builtin_vocabulary(builtin_tokenizer):
    """The built-in tokenizer as llguidance reads it (core.decode.grammar.Vocabulary)."""
    from specx.core.decode.grammar import Vocabulary

    return Vocabulary(builtin_tokenizer, len(builtin_tokenizer), builtin_tokenizer.eos_token_id)
