"""`python -m specx`: the same as the `specx` console script."""

from .commands.app import main

main()
