"""The OpenAI-compatible HTTP API of `specx serve` (Starlette); `specx.server` assembles and runs it, `specx.commands.serve` is the command.

app (the routes, the request body), delivery (the worker's events as answers: a JSON body or an
SSE stream), requests (bodies -> validated GenerationRequests), limits (input bounds before
tokenizing), tokens (prompt tokens, tools into the prompt, grammar checks), responses (bodies,
stream chunks, logprobs, tool-call deltas), errors (ApiError: a refusal as an OpenAI-style error
body). The model itself is core/serve's worker.
"""
