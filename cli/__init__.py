"""specx: speculative decoding drafted from a suffix index over your agents' past outputs.

The package is this folder; its logic is specx.core (core/) and its store specx.store (store/):
cli -> store -> core, each importing only the next ones down.

The library face, which the commands, the examples and the bench use:
    stack       the one assembly of what decoding with a model needs (engine, tokenizer, index,
                cost, drafter, prefix cache): a core.decode.stack.Stack
    backends    the engine `--backend auto` runs (the trial's kept choice, else a prior); kept verdicts
    trial       the engine trial `specx engines` runs (and `specx serve` in the background)
    home        $SPECX_HOME: the default store, the learned forward-pass cost kept per model and machine
    predict     the figures behind `specx entropy` and the projection behind `specx replay`
    replays     the replays behind `specx replay`: model-free, or through a model
    generation  what `specx generate` runs: a prompt decoded, drafted or plainly, the two compared
    server      the server `specx serve` runs, and its settings checked and assembled
    live        a served store watched for new outputs; a shaped stream's pace
    http/       the OpenAI-compatible HTTP API `specx serve` runs
    output      tables, JSON, progress and one-line notes on the terminal

The command line, `commands/`: app (the typer app, `ingest`, `ls`, main()), one module per other
command (entropy, replay, generate, serve, check, merge, engines), options (what they share),
serve_options and replay_options (the options of those two alone). A command parses its options,
calls the library and prints; what the library finds wrong with an option is a stack.SettingError,
which the command turns into the usage error naming it (options.option_errors).

Beside the product: vllm (the vLLM plugin), llama_draft (llama-cpp-python's draft model), and
bench/ (the measuring package: `specx bench`, added by an entry point; the product never imports it).
"""
