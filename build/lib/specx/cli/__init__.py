"""specx command-line interface: a thin typer client of specx.core and specx.store."""
