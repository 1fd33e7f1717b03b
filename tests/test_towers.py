"""The package's structure (issue 32): core/'s towers import one way, nothing imports in a cycle
(imports inside functions and under TYPE_CHECKING included), the floors too (issue 60: the
package, cli/, imports the store and core; store/ imports core; core neither), the package's
modules name each other relatively, the product never imports the measuring package, no product
file passes 350 lines, and nothing outside core/model asks which engine runs a model (issue 40:
the engine answers, core.model.engine), by its class, its name or what it has (`hasattr`, issue
60). Read from the sources with `ast`."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what each tower of core/ may import (besides itself); core.draft, core.numba_cache, core.kept and
# core.kept_schema: anyone
TOWERS = ["index", "model", "cost", "decode", "predict", "serve"]
SHARED = {"specx.core.draft", "specx.core.numba_cache", "specx.core.kept", "specx.core.kept_schema"}


def modules() -> dict[str, Path]:
    """Module name -> file, from pyproject's package-dir mapping (longest folder wins)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = sorted(((ROOT / folder, name) for name, folder in config.items()), key=lambda x: -len(x[0].parts))
    found = {}
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") or part in ("__pycache__", "build") for part in path.relative_to(ROOT).parts):
            continue
        for folder, package in folders:
            if folder in path.parents or path.parent == folder:
                rest = path.relative_to(folder).with_suffix("").parts
                name = ".".join((package, *rest)).removesuffix(".__init__")
                found.setdefault(name, path)
                break
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package `name` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


@pytest.fixture(scope="module")
def graph():
    found = modules()
    assert len(found) > 80 and "specx.core.decode.loop" in found  # the mapping was read
    return {name: imports(name, path, set(found)) for name, path in found.items()}, found


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def against_towers(edges: dict[str, set[str]]) -> list[str]:
    """Imports of core/ modules that point against the towers' order."""
    wrong = []
    for name, targets in edges.items():
        if not name.startswith("specx.core."):
            continue
        tower = name.split(".")[2]
        allowed = TOWERS[: TOWERS.index(tower) + 1] if tower in TOWERS else []
        for target in targets:
            if target in SHARED or not target.startswith("specx.") or target == "specx.core":
                continue
            if not target.startswith("specx.core.") or target.split(".")[2] not in allowed:
                wrong.append(f"{name} -> {target}")
    return sorted(wrong)


FLOORS = ["specx.core", "specx.store", "specx"]  # bottom up: core/, store/, cli/ (the rest of specx)


def floor(name: str) -> int:
    return next(i for i, prefix in enumerate(FLOORS) if name == prefix or name.startswith(prefix + "."))


def against_floors(edges: dict[str, set[str]]) -> list[str]:
    """Imports that point up a floor: core importing the store or cli/, the store importing cli/."""
    return sorted(f"{name} -> {target}" for name, targets in edges.items() for target in targets
                  if target.startswith("specx") and floor(target) > floor(name))


def absolute_imports(source: str) -> list[int]:
    """Lines of `source` that import the package by its absolute name (`from specx.core.x import y`,
    `import specx.store`) rather than relatively (`from .core.x import y`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "specx":
            lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "specx" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_import_cycle(graph):
    cycle = find_cycle(graph[0])
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_towers_import_one_way(graph):
    wrong = against_towers(graph[0])
    assert not wrong, "imports against the towers' direction:\n" + "\n".join(wrong)


def test_setup_finds_the_folders_pyproject_maps():
    """setup.py finds the packages in the folders pyproject.toml's package-dir maps (one mapping, two files)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assignments = [n for n in ast.parse((ROOT / "setup.py").read_text()).body if isinstance(n, ast.Assign)]
    folders = next(ast.literal_eval(n.value) for n in assignments if n.targets[0].id == "FOLDERS")
    assert folders == config == {"specx": "cli", "specx.core": "core", "specx.store": "store"}


def test_floors_import_down(graph):
    wrong = against_floors(graph[0])
    assert not wrong, "imports up a floor (core <- store <- cli):\n" + "\n".join(wrong)


def test_the_package_imports_itself_relatively(graph):
    """The package's modules (cli/, store/, core/) import each other relatively, so a drawing of the
    folders' imports connects them; tests and examples use the absolute names."""
    _, found = graph
    wrong = [f"{name}:{line}" for name, path in found.items() for line in absolute_imports(path.read_text())]
    assert not wrong, "absolute imports of specx in the package:\n" + "\n".join(wrong)


def test_the_product_never_imports_the_bench(graph):
    edges, _ = graph
    wrong = [f"{m} -> {t}" for m, ts in edges.items() if not m.startswith("specx.bench")
             for t in ts if t.startswith("specx.bench")]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_product_file_over_350_lines(graph):
    _, found = graph
    long = {name: n for name, path in found.items() if not name.startswith("specx.bench")
            and (n := len(path.read_text().splitlines())) > 350}
    assert not long, long


# the engines (core.model.engine.Engine's implementations) and their sessions, and the test of which
# one runs that they replaced; test_every_engine_class_is_known finds them in core/model
ENGINE_CLASSES = {"LlamaModel", "TransformersEngine", "TransformersSession", "SessionEngine", "Session",
                  "QuantEngine", "GPUEngine"}
ENGINE_CHECKS = {"on_llamacpp"}
# what only an engine, its session or its model has: `hasattr(x, one)` asks which engine x is
ENGINE_ATTRIBUTES = {"start", "start_steps", "score_batch", "forward_batch", "keep_path", "new_prefix_cache",
                     "tune_threads", "cost_key", "tree_unsupported", "compile_seconds", "weight_bytes",
                     "multiply_adds"}


def engine_tests(source: str) -> list[int]:
    """Lines of `source` that ask which engine they have: isinstance/issubclass or `type(x) is`
    against an engine class, an engine check by name, or `hasattr` of an engine (a name or
    attribute `engine`, e.g. `self.engine`, `engine.model`) or of what only an engine has."""

    def names(node: ast.AST) -> set[str]:
        return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
                if isinstance(n, (ast.Name, ast.Attribute))}

    lines = []
    for node in ast.walk(ast.parse(source)):
        call = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
        if call in ("isinstance", "issubclass"):
            if len(node.args) == 2 and names(node.args[1]) & ENGINE_CLASSES:
                lines.append(node.lineno)
        elif call == "hasattr" and len(node.args) == 2:
            asked = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            if any("engine" in n.lower() for n in names(node.args[0])) or asked in ENGINE_ATTRIBUTES:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.Eq)) for op in node.ops):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(x, ast.Call) and isinstance(x.func, ast.Name) and x.func.id == "type" for x in sides)
            if typed and any(names(x) & ENGINE_CLASSES for x in sides if not isinstance(x, ast.Call)):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name) else node.attr) \
                in ENGINE_CHECKS:
            lines.append(node.lineno)
    return sorted(set(lines))


def engine_classes(paths: list[Path]) -> set[str]:
    """Classes of `paths` that are engines or sessions (core.model.engine's Engine: `start` and
    `plain`; Session: `score` and `keep_path`), methods defined or assigned, and their subclasses
    (core.model.sessions.SessionEngine's engines), named as a base by its name."""
    found, bases = set(), {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                members = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                members |= {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                            if isinstance(t, ast.Name)}
                if {"start", "plain"} <= members or {"score", "keep_path"} <= members:
                    found.add(node.name)
                bases[node.name] = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                    if isinstance(b, (ast.Name, ast.Attribute))}
    while more := {name for name, of in bases.items() if of & found} - found:
        found |= more
    return found


def test_no_engine_test_outside_the_engines(graph):
    """What differs between engines is the engine's to answer (core.model.engine.Engine): no module
    outside core/model, product or example, tests which engine it has. ENGINE_CLASSES names every
    engine and session class of core/model (the protocol's own aside): a new engine is checked for
    as soon as it lands."""
    model = ROOT / "core" / "model"
    classes = engine_classes([p for p in sorted(model.rglob("*.py")) if p != model / "engine.py"])
    assert classes == ENGINE_CLASSES
    _, found = graph
    paths = {name: path for name, path in found.items() if not name.startswith("specx.core.model")}
    paths |= {f"examples/{p.name}": p for p in sorted((ROOT / "examples").glob("*.py"))}
    wrong = [f"{name}:{line}" for name, path in paths.items() for line in engine_tests(path.read_text())]
    assert not wrong, "engine tests outside core/model:\n" + "\n".join(wrong)


def test_the_checks_can_fail(graph):
    """A planted import from the index into the decode loop is against the towers and closes a
    cycle (the loop reaches the index through the drafters)."""
    edges, _ = graph
    planted = {k: set(v) for k, v in edges.items()}
    planted["specx.core.index.suffix_index"].add("specx.core.decode.loop")
    assert against_towers(planted) == ["specx.core.index.suffix_index -> specx.core.decode.loop"]
    assert find_cycle(planted) is not None
    planted["specx.store.db"].add("specx.stack")
    planted["specx.core.draft"].add("specx.store.db")
    assert against_floors(planted) == ["specx.core.draft -> specx.store.db", "specx.store.db -> specx.stack"]
    assert absolute_imports("from specx.core.draft import Draft\nimport specx.store\nfrom .core import draft\n"
                            "from specxy import z\n") == [1, 2]
    planted_tests = ("x = isinstance(model, LlamaModel)\nif on_llamacpp(model): pass\n"
                     "y = type(engine) is llamacpp.LlamaModel\nz = isinstance(model, (int, str))\n")
    assert engine_tests(planted_tests) == [1, 2, 3]
    planted_sniffs = ("a = hasattr(engine, 'compile_seconds')\nb = hasattr(self.engine, 'anything')\n"
                      "c = hasattr(model, 'forward_batch')\nd = hasattr(getattr(engine, 'model', None), 'x')\n"
                      "e = isinstance(x, (QuantEngine, GPUEngine))\nf = hasattr(value, 'tolist')\n")
    assert engine_tests(planted_sniffs) == [1, 2, 3, 4, 5]
