"""Where numba keeps the compiled kernels: a folder keyed by numba's version and the kernels' sources.

numba checks a cached function against its own file's timestamp only, but several kernels inline
functions from other files (``inline="always"``): after an edit or a ``git pull`` that touches only
the callee, the caller's stale machine code would be loaded and return garbage. So the cache lives
in a folder named for numba's version and a hash of every kernel source file (`sources()`: each
file that uses numba or llvmlite, and the quantized engine's room whole): any change there
compiles afresh, and two venvs with different numba versions on one checkout do not overwrite each
other.

numba reads the folder when a kernel is decorated, so every module that defines kernels calls
`configure()` first (once per process; the other modules of specx import no numba). Old folders
are removed by `prune()`, which the command line runs, never an import.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil

_HERE = pathlib.Path(__file__).resolve().parent
_folder: pathlib.Path | None = None


def _base() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("NUMBA_CACHE_DIR") or _HERE / "__pycache__")
    if not os.access(base if base.exists() else base.parent, os.W_OK):
        base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "specx"
    return base


def _prefix() -> str:
    import numba

    return f"specx-numba-{numba.__version__}-"


def sources() -> list[pathlib.Path]:
    """The files whose text keys the cache folder: every file of core/ that uses numba or llvmlite,
    and the quantized engine's room whole (its packed layouts are read by the kernels' IR)."""
    return [path for path in sorted(_HERE.rglob("*.py")) if path.name != "numba_cache.py"
            and ("quantized" in path.relative_to(_HERE).parts
                 or any(word in path.read_bytes() for word in (b"numba", b"llvmlite")))]


def configure() -> pathlib.Path:
    """Point numba's cache at this version's and these sources' folder (idempotent); returns it."""
    global _folder
    if _folder is None:
        from numba.core import config

        digest = hashlib.sha1()
        for path in sources():
            digest.update(str(path.relative_to(_HERE)).encode() + b"\0" + path.read_bytes())
        _folder = _base() / (_prefix() + digest.hexdigest()[:16])
        config.CACHE_DIR = str(_folder)
        _pickle_llvm_types_without_caches()
        _parallel_loops_named_per_process()
        _cache_files_locked()
    return _folder


def _cache_files_locked() -> None:
    """numba saves a compiled function in two steps, each file replaced whole: it reads the index
    (key -> data file), adds the new key with the first unused data file's name, writes the index,
    then the data. Two processes that compile one function at once (a server and a command, the
    tests' processes, every new cache) both take the same name: one's index entry is lost and the
    data file may hold the other's code under it, which a third process then loads for a key it
    was not compiled for (numba/numba#10128; seen here: 1 to 3 of 8 processes' entries lost,
    and a quantized engine's start aborted in parse_bitcode). A lock on the index (flock, beside it) makes
    a save one step and a load see an index and its data together."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): numba's own behaviour
        return
    from numba.core import caching

    def locked(method, mode):  # noqa: ANN001, ANN202
        def run(self, *args):  # noqa: ANN001, ANN002, ANN202
            try:
                fd = os.open(self._index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # a cache folder this process cannot write: read as numba would
                return method(self, *args)
            try:
                fcntl.flock(fd, mode)
                return method(self, *args)
            finally:
                os.close(fd)  # releases the lock
        run.specx_locked = True
        return run

    files = caching.IndexDataCacheFile
    if not getattr(files.save, "specx_locked", False):
        files.save = locked(files.save, fcntl.LOCK_EX)
        files.load = locked(files.load, fcntl.LOCK_SH)


def _parallel_loops_named_per_process() -> None:
    """numba names the function it makes of a parallel loop by hash(parfor), which is id(): a memory
    address. Processes that allocate alike give different loops the same name, and two cached
    libraries written by two processes, loaded into a third, then share a symbol for different
    code: a call lands in the other library's loop (seen here: the built-in model's logits wrong
    after an AVX2 kernel test had loaded its own cached driver). A random salt per process keeps
    every process's names apart; within a process hash stays one-to-one with id."""
    from numba.parfors import parfor

    salt = int.from_bytes(os.urandom(7), "little") << 8
    parfor.Parfor.__hash__ = lambda self: id(self) ^ salt


def _rebuild_llvm_type(cls: type, state: dict):  # noqa: ANN205 - an llvmlite type
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _pickle_llvm_types_without_caches() -> None:
    """llvmlite's IR types remember their printed form once printed, which changes their pickle: an
    intrinsic's definition that names a type (every kernel's does) would pickle one way before its
    first compile and another after, and numba's cache would key the same kernel two ways (found
    by neither). Pickled without the remembered string, a type pickles the same before and after."""
    import copyreg

    from llvmlite.ir import types as ir_types

    def reduce(t):  # noqa: ANN001, ANN202
        return _rebuild_llvm_type, (type(t), {k: v for k, v in vars(t).items() if "cached" not in k})

    for cls in vars(ir_types).values():
        if isinstance(cls, type) and issubclass(cls, ir_types.Type):
            copyreg.pickle(cls, reduce)


def prune() -> int:
    """Remove this numba version's cache folders of older sources; returns how many."""
    folder, base = configure(), _base()
    removed = 0
    if base.is_dir():
        for old in base.glob(_prefix() + "*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
                removed += 1
    return removed


def fixed(obj, key: str):  # noqa: ANN001, ANN201 - a numba dispatcher or intrinsic, returned
    """Give a numba dispatcher or intrinsic an identity fixed by `key` instead of a random uuid.

    numba keys a cached closure by a pickle of its cells, and a dispatcher or intrinsic pickles as
    its uuid (random per process): a compiled function that reaches one through a closure (the
    quantized engine's layers reach every kernel that way) would never be found in the cache
    again. Named by what they compute, they pickle the same in every process, and a second start
    loads the machine code instead of compiling it."""
    obj._set_uuid(f"specx:{key}")
    return obj


def fix_module(namespace: dict) -> None:
    """`fixed` for every numba dispatcher and intrinsic defined at the top of a module (they are
    pickled by value with the functions that name them as globals)."""
    from numba.core.dispatcher import Dispatcher
    from numba.core.extending import _Intrinsic

    module = namespace["__name__"]
    for name, obj in list(namespace.items()):
        if isinstance(obj, (Dispatcher, _Intrinsic)) and obj.__module__ == module:
            fixed(obj, f"{module}.{name}")
