import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its own library functions are compiled
# then), and other tests' imports (transformers) may import it first: without CUDA the GPU engine's
# kernels run in its interpreter (tests/test_gpu_engine.py), so it is set before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specx.core.model.load import warm_up_math  # noqa: E402

from helpers.cli import specx_test_home  # noqa: E402

# Tests build tiny models without load_model: settle torch's first-call math for them too (see there).
warm_up_math()
# The tests written for the transformers engine keep it (their references are its numerics), module
# fixtures and the servers they start included; tests/test_llamacpp.py asks for llama.cpp by name.
os.environ["SPECX_BACKEND"] = "transformers"


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
def builtin_model(tmp_path_factory):
    """The built-in model and its tokenizer, loaded once for the tests that decode with it and only
    read it (the first load converts its GGUF into the tests' models folder, ~30 s; later ones, in
    the commands the tests run, read that copy)."""
    from specx.core.model.load import load_model

    return load_model("smollm2-135m", specx_test_home(tmp_path_factory) / "models", device="cpu")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """`specx serve --api-key` on the built-in model, one process for the session: the requests of
    test_serve.py and test_serve_agents.py share it (servers started with other options, or for one
    test, are test_serve_lifecycle.py's)."""
    from helpers.servers import KEY, Server

    srv = Server(str(specx_test_home(tmp_path_factory)), tmp_path_factory.mktemp("serve") / "served.db", "--api-key", KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def builtin_vocabulary(builtin_tokenizer):
    """The built-in tokenizer as llguidance reads it (core.decode.grammar.Vocabulary)."""
    from specx.core.decode.grammar import Vocabulary

    return Vocabulary(builtin_tokenizer, len(builtin_tokenizer), builtin_tokenizer.eos_token_id)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The built-in model's tokenizer as ingest takes it (store.ingest.Tokenizer: loaded when first
    needed); test_store_hostile.py and test_store_damage.py load theirs at once (helpers.stores)."""
    from specx.core.model.load import load_tokenizer, tokenizer_fingerprint
    from specx.store.ingest import Tokenizer

    cache = tmp_path_factory.getbasetemp() / "specx-home" / "models"
    return Tokenizer("smollm2-135m", lambda: load_tokenizer("smollm2-135m", cache), tokenizer_fingerprint)
