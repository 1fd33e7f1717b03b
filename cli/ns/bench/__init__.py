"""specx's measuring library: what `specx replay`, `specx bench` and the examples measure with.

    replay      every method replays the same stored calls with the simulated verifier (and,
                with --model, the model): the figures of `specx replay`
    compare     decoding methods side by side on the same prompts (plain, prompt lookup, specx)
    figures     the suffix index's and ingest's figures of `specx bench`, against their targets
    calibrate   a model's verification passes timed over 1..n tokens (`specx bench cost`)
    reference   ArcticInference's C++ suffix tree, when importable, as a drafter and a benchmark
    synthetic   a seeded corpus that looks like agent output

It sits beside the product (core/ the logic, store/ the store, cli/ the commands), not in it: it
drives them and times them. Its folder is cli/ns/bench because cli/ns is the `specx` package
itself (the top-level folders of this repository are fixed; specx.vllm lives there too).
"""
