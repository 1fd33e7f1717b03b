"""specx's measuring package: what `specx bench` and the examples measure with.

    command     `specx bench index`, `ingest`, `cost` and `tasks` (added to the CLI by an entry point)
    figures     the suffix index's and ingest's figures of `specx bench`, against their targets
                (ArcticInference's alongside when importable)
    calibrate   a model's verification passes timed over 1..n tokens (`specx bench cost`)
    synthetic   a seeded corpus that looks like agent output
    proposers   vLLM's proposers timed inside its engine (the bench's own vLLM plugin)
    tasks       recorded agent tasks (a session's calls as turns), cut to a context; median and p90
    chat_stream one streamed, timed chat completion against any OpenAI-compatible server
    task_servers the servers `bench tasks` starts itself (specx, plain specx, llama-server, its n-gram drafts)
    task_bench  tasks played against one server, and its row of figures; the plot
    task_runs   one sitting of `bench tasks`: servers in turn, the report

The replays `specx replay` reports and the decoding comparisons are the product's
(core.predict.methods, core.predict.compare).

It sits beside the product (specx.core the logic, specx.store the store, specx.commands the
commands), not in it: it drives them and times them.
"""
