"""Serving: the worker thread that owns the model for `specx serve`, its metrics, tool calls.

Owns: requests as they are decoded (`worker`: a bounded queue, one request at a time or several
batched: `batch`, the passes they share, and `request_view`, each one's view of them; `choice_stream`,
one choice decoded and streamed), what is kept of them (`keeper`: the Recorder, the index persisted),
what it sends back to the HTTP side (`events`: typed, matched by type), what a request reports and the
Prometheus metrics (`metrics`), OpenAI tool calls without HTTP (`tools`: validation, prompts, the
grammar that forces calls; `tool_calls`: the output formats, parsing), a shaped stream's clock
(`pace`). HTTP itself is cli/http/'s.

May import: every other tower.
"""
