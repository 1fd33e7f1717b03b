"""Every docstring example (`>>>`) in the package runs as a test.

The modules are found by walking the source folders for files that hold `>>>`, so a module that
gains its first example is tested without anyone listing it here. Each module is one test case
(a failure names the module). No example may load a model: the loaders refuse while they run.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# pyproject.toml's package-dir: source folder -> package (the longest folder that holds a file wins)
PACKAGE_DIRS = {
    "cli": "specx",
    "core": "specx.core",
    "store": "specx.store",
}
SOURCE_FOLDERS = ("core", "store", "cli")

# packages of the optional extras (pyproject's [project.optional-dependencies]) and of vLLM's own
# venv: a module that needs one of these is skipped where it is absent; any other failed import fails
OPTIONAL = {"llama_cpp", "vllm"}

OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: Path) -> str:
    """The module a source file installs as: core/cost/forward.py -> specx.core.cost.forward,
    cli/vllm.py -> specx.vllm, store/formats/__init__.py -> specx.store.formats."""
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    for folder in sorted(PACKAGE_DIRS, key=lambda f: -len(Path(f).parts)):
        prefix = Path(folder).parts
        if parts[: len(prefix)] == prefix:
            return ".".join([PACKAGE_DIRS[folder], *parts[len(prefix):]])
    raise AssertionError(f"{path} is under no package folder of pyproject.toml")


def modules_with_examples() -> dict[str, int]:
    """module -> how many examples its source holds (`>>>` prompts, less those marked +SKIP)."""
    found = {}
    for folder in SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            if ">>>" in text:
                prompts = [line for line in text.splitlines() if line.lstrip().startswith(">>>")]
                found[module_name(path)] = sum("+SKIP" not in line for line in prompts)
    return dict(sorted(found.items()))


MODULES = modules_with_examples()


def test_module_names_follow_the_package_mapping():
    assert module_name(ROOT / "core/cost/forward.py") == "specx.core.cost.forward"
    assert module_name(ROOT / "store/formats/_chat.py") == "specx.store.formats._chat"
    assert module_name(ROOT / "cli/vllm.py") == "specx.vllm"
    assert module_name(ROOT / "cli/bench/command.py") == "specx.bench.command"
    assert module_name(ROOT / "cli/commands/app.py") == "specx.commands.app"
    assert module_name(ROOT / "core/index/__init__.py") == "specx.core.index"


def test_discovery_finds_the_modules_with_examples():
    assert len(MODULES) >= 15, MODULES
    assert "specx.core.cost.forward" in MODULES and "specx.store.ingest" in MODULES


@pytest.fixture
def no_model_loads(monkeypatch):
    """Make every way specx loads a model (or its tokenizer) fail the example that tries it."""
    from specx.core.model import llamacpp, load

    def refuse(*args, **kwargs):
        raise AssertionError("a docstring example must not load a model")

    for name in ("load_model", "load_backend", "load_tokenizer"):
        monkeypatch.setattr(load, name, refuse)
    monkeypatch.setattr(llamacpp.LlamaModel, "__init__", refuse)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, no_model_loads):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in OPTIONAL:
            raise
        pytest.skip(f"could not import {exc.name!r}: {exc}")
    result = doctest.testmod(module, optionflags=OPTIONFLAGS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (see stdout)"
    assert result.attempted >= 1, f"{name} holds '>>>' but doctest found no example to run"
    # an example doctest cannot find (in a comment, or in the docstring of an object doctest does
    # not search, such as a jitted function) is never checked: every one in the source must run
    assert result.attempted == MODULES[name], (
        f"{name}: its source holds {MODULES[name]} examples but doctest ran {result.attempted}")
