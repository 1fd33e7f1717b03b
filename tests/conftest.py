import os
from pathlib import Path

import pytest

from specx.core.model import warm_up_math

REPO = Path(__file__).resolve().parents[1]
AGENT_DATA = REPO.parent / "shared" / "agent-data"

# Tests build tiny models without load_model: settle torch's first-call math for them too (see there).
warm_up_math()


@pytest.fixture(autouse=True)
def _specx_home(tmp_path_factory, monkeypatch):
    # Never write caches into the user's home from tests; share one per session (tokenizer cache).
    home = os.environ.get("SPECX_TEST_HOME") or str(tmp_path_factory.getbasetemp() / "specx-home")
    monkeypatch.setenv("SPECX_HOME", home)
