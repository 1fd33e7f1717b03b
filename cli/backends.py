"""`--backend auto` and what `specx engines` keeps: which engine runs the model, proven and measured here.

Two things are kept per machine in $SPECX_HOME/engines (JSON, one file each):

- a probe verdict per machine, llama.cpp build and model (core.model.probe): llama.cpp's native code
  is run in a child process before specx first runs it in its own; a child killed by a signal
  makes `auto` run on transformers and `--backend llama.cpp` a one-line error;
- an engine choice per machine, build and model (core.predict.engines): a trial of specx on every
  engine that can hold the model, on the store's own prompts, side by side with llama.cpp's plain
  decoding. `specx engines` (cli/trial.py) runs it in the foreground; `specx serve` in a child process in the
  background when there is none, and uses it from the next start.

Until a trial has run, `auto` takes the prior of the shipped measurements (docs/llamacpp.md):
for the built-in model transformers on a CPU with AVX-512 (1.53x llama.cpp there), llama.cpp
elsewhere and for other GGUF files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core.model import cpu
from .core.model.llamacpp import file_digest
from .core.model.probe import Verdict, prove

from .home import specx_home

KEPT_MAX_BYTES = 1 << 20  # a kept verdict or choice is a few kB: anything larger is not one
REVISIT_MIN_STEPS = 2000  # served steps before serve compares their tokens per step with the trial's
REVISIT_RATIO = 1.4  # ... and measures again when they differ by more than this factor
DEQUANTIZED_BYTES_PER_GGUF_BYTE = 8  # transformers holds a 4-bit GGUF's weights in float32
# ------------------------------------------------------------------ kept files

def kept_path(kind: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return specx_home() / "engines" / f"{kind}-{digest}.json"


def read_kept(path: Path, say: Callable[[str], None], check: Callable[[Any], Any] | None = None) -> Any:
    """A kept JSON object (core.kept: a regular file, size-bounded, never a FIFO or a device), passed
    through `check` (core.kept_schema's check of its kind, on the object) when given; one that
    cannot be used, as bytes or by its shape, is set aside with one line, and None comes back."""
    from .core.kept import Unusable, read_kept_json

    try:
        data = read_kept_json(path, KEPT_MAX_BYTES)
        if data is None:
            return None
        if not isinstance(data, dict):
            raise Unusable("is not a JSON object")
        return check(data) if check is not None else data
    except Unusable as exc:
        set_kept_aside(path, str(exc), say)
    return None


def set_kept_aside(path: Path, why: str, say: Callable[[str], None]) -> None:
    """Set aside a kept file that cannot be used, with one line naming it and why."""
    from .core.kept import set_aside

    aside = set_aside(path)
    say(f"cannot use {path} ({why}): " + (f"set aside as {aside.name}" if aside else "it could not be set aside"))


def write_kept(path: Path, data: dict[str, Any], say: Callable[[str], None]) -> None:
    from .core.kept import write_kept_json

    try:
        write_kept_json(path, data)
    except (OSError, ValueError) as exc:
        say(f"cannot keep {path} ({exc})")


# ------------------------------------------------------------------ what is there

def llama_build() -> dict[str, Any] | None:
    """What identifies the installed llama-cpp-python build (its version and its libraries' sizes
    and times), found without importing it; None when it is not installed."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    files = sorted(lib.glob("*.so*")) + sorted(lib.glob("*.dylib")) + sorted(lib.glob("*.dll"))
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    try:
        release = version("llama-cpp-python")
    except PackageNotFoundError:
        release = "unknown"
    return {"llama_cpp": release, "libraries": hashlib.sha256(repr(stats).encode()).hexdigest()[:16]}


def gguf_file(model: str) -> Path | None:
    """The GGUF file behind `model` (the built-in model's, or a .gguf path), else None."""
    from .core.model.load import BUILTIN, builtin_gguf

    if model in BUILTIN:
        return builtin_gguf(model)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" else None


def _probe_key(path: Path) -> dict[str, Any]:
    return {"machine": cpu.fingerprint(), "build": llama_build(), "model": file_digest(path)}


def llama_verdict(path: Path, say: Callable[[str], None], command: list[str] | None = None) -> Verdict:
    """Whether llama.cpp runs `path` on this machine and build: kept, else proven in a child."""
    key = _probe_key(path)
    kept_at = kept_path("probe", key)
    kept = read_kept(kept_at, say, _kept_verdict)
    if kept is not None:
        return Verdict(**kept)
    say("proving llama.cpp on this machine in a test process (once per machine, build and model) ...")
    verdict = prove("llama.cpp", path, command)
    write_kept(kept_at, {"key": key, "verdict": verdict.to_json()}, say)
    return verdict


def _kept_verdict(doc: dict[str, Any]) -> dict[str, Any]:
    from .core.kept_schema import check_verdict

    return check_verdict(doc.get("verdict"))


def engine_names() -> list[str]:
    """The engines a kept choice may name: every backend but `auto`."""
    from .core.model.load import BACKENDS

    return [b for b in BACKENDS if b != "auto"]


def transformers_fits(path: Path) -> bool:
    """Whether transformers can hold the GGUF at `path` de-quantized, in half the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return True
    return path.stat().st_size * DEQUANTIZED_BYTES_PER_GGUF_BYTE <= total // 2


def choice_key(model: str, path: Path) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return {"machine": cpu.fingerprint(), "build": llama_build(), "model": model, "file": file_digest(path)} | versions


def kept_choice(model: str, path: Path, say: Callable[[str], None]) -> Any:
    """The engine choice a trial made for this model here (core.predict.engines.Choice), or None."""
    from .core.predict.engines import Choice

    return read_kept(kept_path("choice", choice_key(model, path)), say,
                     lambda doc: Choice.from_json(doc.get("choice"), engine_names()))


def quantized_runs(path: Path, say: Callable[[str], None] = lambda m: None) -> bool:
    """Whether specx's quantized engine (core/model/quantized/engine.py) runs the GGUF at `path`; when not, says why."""
    from .core.model.quantized.model import unsupported

    why = unsupported(path)
    if why:
        say(f"quantized engine: {why}")
    return why is None


def gpu_runs(path: Path, say: Callable[[str], None] = lambda m: None) -> bool:
    """Whether specx's GPU engine (core/model/gpu/engine.py) runs the GGUF at `path` here: a CUDA
    GPU, Triton, and an architecture it reads; when the GPU is here but the file is not for it, says why."""
    from .core.model.gpu.engine import available, unsupported

    if not available():
        return False
    why = unsupported(path)
    if why:
        say(f"gpu engine: {why}")
    return why is None


def prior_engine(model: str, quantized: bool = False) -> tuple[str, str]:
    """The engine before any trial here, and why (the shipped measurements); `quantized`: the
    quantized engine runs the model's file (quantized_runs said so)."""
    from .core.model.quantized import target
    from .core.model.load import BUILTIN

    if quantized and target.isa() == "avx512vnni":
        return "quantized", ("prior: on an AVX-512 VNNI CPU (AMD EPYC Zen 4) specx on its quantized engine ran the "
                             "built-in model at 2.49x / 2.62x llama.cpp's plain decoding, text-to-SQL 3-/0-shot "
                             "(docs/quantized.md)")
    if quantized and target.isa() in ("avxvnni", "avx2"):
        return "quantized", ("prior: with its AVX2 / AVX-VNNI kernels the quantized engine's one-token pass took "
                             "0.64x llama.cpp's (AVX2 builds of both) and its prefill 0.46x, the built-in model "
                             "(docs/quantized.md)")
    if model in BUILTIN and "avx512f" in cpu.flags():
        return "transformers", "prior: the built-in model ran 1.53x faster there than on llama.cpp on an AVX-512 Xeon"
    return "llama.cpp", "prior: on AVX2 CPUs, and for GGUF files in general, llama.cpp is the faster engine"


def resolve_backend(model: str, backend: str, say: Callable[[str], None]) -> str:
    """The engine `backend` means for `model` here: llama.cpp, transformers, quantized or gpu. `auto`
    takes a trial's choice when one was made here (the GPU engine only so: it is never the prior),
    else the prior; llama.cpp only once a child
    process has run it without dying (else auto says why and takes the quantized engine or
    transformers; an explicit llama.cpp is a ModelError naming the signal); the quantized engine
    only for a file whose architecture and tensor types it runs (else auto says which it cannot)."""
    from .core.model import llamacpp
    from .core.model.load import BACKENDS, ModelError

    if backend not in BACKENDS:
        raise ModelError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    path = gguf_file(model)
    if backend in ("transformers", "quantized", "gpu") or path is None:
        return "transformers" if backend == "auto" else backend  # load_backend names what is missing
    if not path.is_file():
        return backend if backend != "auto" else "llama.cpp"  # load_backend names the missing file
    if backend == "auto" and gpu_runs(path, say):
        choice = kept_choice(model, path, say)
        if choice is not None and choice.engine == "gpu":
            say(choice.line())
            return "gpu"
        if choice is None:  # not before it has run on a GPU here: its CUDA kernels are not yet proven on any
            say("a CUDA GPU is here: `specx engines` tries specx's GPU engine (bfloat16, draft trees, batched "
                "requests; --backend gpu), and auto takes it once that trial chooses it")
    quantized = backend == "auto" and quantized_runs(path, say)
    if not llamacpp.available():
        return backend if backend != "auto" else ("quantized" if quantized else "transformers")
    verdict = llama_verdict(path, say)
    if not verdict.ok:
        if backend == "llama.cpp":
            raise ModelError(f"{verdict.message}; run it with --backend transformers or --backend quantized "
                             f"(docs/llamacpp.md, \"The build\", says how to rebuild llama-cpp-python)")
        engine = "quantized" if quantized else "transformers"
        say(f"{verdict.message}: running on {engine}")
        return engine
    if backend == "llama.cpp":
        return backend
    choice = kept_choice(model, path, say)
    if choice is not None and (choice.engine == "llama.cpp" or (choice.engine == "quantized" and quantized) or (
            choice.engine == "transformers" and transformers_fits(path))):
        say(choice.line())
        return choice.engine
    if not quantized and not transformers_fits(path):
        say("engine: llama.cpp (transformers would not hold the model de-quantized in this machine's memory)")
        return "llama.cpp"
    engine, why = prior_engine(model, quantized)
    say(f"engine: {engine} ({why}; not measured on this machine yet: `specx engines` measures it)")
    return engine


def trial_possible(model: str) -> bool:
    """Whether a trial has something to choose for `model` here: a GGUF that llama.cpp ran in its
    probe and transformers can hold."""
    from .core.model import llamacpp
    path = gguf_file(model)
    if path is None or not path.is_file() or not llamacpp.available():
        return False
    verdict = read_kept(kept_path("probe", _probe_key(path)), lambda m: None, _kept_verdict)
    return verdict is not None and verdict["ok"] and (transformers_fits(path) or quantized_runs(path))


def kept_choice_for(model: str) -> Any:
    """kept_choice for a model name (None for a model that is not a GGUF file)."""
    path = gguf_file(model)
    return kept_choice(model, path, lambda m: None) if path is not None and path.is_file() else None


def start_trial(model: str, db: Path) -> subprocess.Popen:
    """`specx engines --json` in a child process at low priority (serve's background trial)."""
    command = [sys.executable, "-c", "from specx.commands.app import main; main()", "engines", "--model", model,
               "--json"] + (["--db", str(db)] if db.is_file() else [])  # a trial refuses a --db that is no store
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_background_child)


def _background_child() -> None:
    """In the trial's child before it runs: low priority, and ended when the server ends (Linux:
    the parent's death sends it SIGTERM), so no trial outlives the server that started it."""
    import ctypes
    import signal

    os.nice(10)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def trial_lock(say: Callable[[str], None] = lambda m: None) -> Any:
    """An exclusive lock on $SPECX_HOME/engines/trial.lock (an open file), or None when another
    trial holds it: two trials at once would measure each other. The lock file is opened as kept
    files are (core.kept.open_kept_lock: a regular file only, never blocking): anything else there
    (a FIFO, a directory) is set aside with one line and a new lock file made."""
    import fcntl

    from .core.kept import Unusable, open_kept_lock

    path = specx_home() / "engines" / "trial.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open_kept_lock(path)
    except Unusable as exc:
        set_kept_aside(path, str(exc), say)
        try:
            f = open_kept_lock(path)
        except Unusable as again:  # it could not be set aside: one line (main() turns OSError into one)
            raise OSError(f"cannot use {path} ({again})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f
