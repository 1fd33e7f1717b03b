"""specx command-line interface: a thin typer client of specx.core and specx.store.

The commands (`app`: ingest, ls, replay and the app itself; `entropy`, `generate`, `serve`, `check`,
`merge`, `trial`: `specx engines`), what they share (`options`, `output`), the engine choice of
`--backend auto` (`engines`), the predictor behind entropy and replay (`predict`), the one assembly
of what decoding with a model needs (`assemble`), and the HTTP API `specx serve` runs (`http/`).
`ns/` is the `specx` package itself (the vLLM plugin, llama-cpp-python's draft model, the
measuring package specx.bench).
"""
