"""specx's packages, found by setuptools rather than listed: specx is cli/, specx.core core/,
specx.store store/ (pyproject.toml's package-dir, which holds the rest of the configuration), each
with the packages find_namespace_packages finds in its folder (core/cost/curves, data only, too)."""

from setuptools import find_namespace_packages, setup

FOLDERS = {"specx": "cli", "specx.core": "core", "specx.store": "store"}  # as pyproject.toml's package-dir

setup(packages=[f"{name}.{sub}" if sub else name for name, folder in FOLDERS.items()
                for sub in ["", *find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])]])
