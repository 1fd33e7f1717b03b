"""The `specx` commands (typer): each parses its options, calls the library (specx.stack,
specx.backends, specx.core, specx.store, ...) and prints. app holds the typer app and main()."""
