"""Where numba keeps the compiled kernels: a folder keyed by numba's version and the kernels' sources.

numba checks a cached function against its own file's timestamp only, but several kernels inline
functions from other files (``inline="always"``): after an edit or a ``git pull`` that touches only
the callee, the caller's stale machine code would be loaded and return garbage. So the cache lives
in a folder named for numba's version and a hash of every kernel source file: any change there
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


def configure() -> pathlib.Path:
    """Point numba's cache at this version's and these sources' folder (idempotent); returns it."""
    global _folder
    if _folder is None:
        from numba.core import config

        digest = hashlib.sha1()
        for path in sorted(_HERE.rglob("*.py")):
            source = path.read_bytes()
            if b"numba" in source and path.name != "numba_cache.py":
                digest.update(str(path.relative_to(_HERE)).encode() + b"\0" + source)
        _folder = _base() / (_prefix() + digest.hexdigest()[:16])
        config.CACHE_DIR = str(_folder)
    return _folder


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
