"""specx core.

The compiled kernels are cached on disk (numba ``cache=True``). numba checks a cached function
against its own file's timestamp only, but several kernels inline functions from other files
(``inline="always"``): after an edit or a ``git pull`` that touches only the callee, the caller's
stale machine code would be loaded and return garbage. So the cache lives in a folder named for
numba's version and a hash of every kernel source file: any change there compiles afresh, and
two venvs with different numba versions on one checkout do not overwrite each other.
"""
import hashlib
import os
import pathlib
import shutil


def _keyed_numba_cache() -> None:
    import numba
    from numba.core import config

    here = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(here.glob("*.py")):
        source = path.read_bytes()
        if b"numba" in source:
            digest.update(path.name.encode() + b"\0" + source)
    prefix = f"specx-numba-{numba.__version__}-"
    base = pathlib.Path(os.environ.get("NUMBA_CACHE_DIR") or here / "__pycache__")
    if not os.access(base if base.exists() else base.parent, os.W_OK):
        base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "specx"
    folder = base / (prefix + digest.hexdigest()[:16])
    if base.is_dir():  # drop this numba version's caches of older sources
        for old in base.glob(prefix + "*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    config.CACHE_DIR = str(folder)


_keyed_numba_cache()
