"""`python -m specx`: the same as the `specx` console script."""

from specx.cli.app import main

main()
