"""How a validated request meets the model: prompt tokens (chat template, tools) and grammars.

`Tokenizers` holds the server's tokenizer, its grammar vocabulary (core.decode.grammar) and its tool-call
format (core.serve.tools); requests.parse_request asks it for a request's tokens and grammar.
"""

from __future__ import annotations

from typing import Any

from ..core.decode.grammar import GrammarError
from ..core.model.chat import chat_tokens
from ..core.serve.job import LockedTokenizer
from ..core.serve.tools import (ToolChoice, ToolsError, check_tool_choice, check_tools, messages_for_plain_template,
                                parser_for_template)

from .errors import ApiError


class Tokenizers:
    """How a validated request becomes prompt tokens (the same calls as `specx generate`)."""

    def __init__(self, tokenizer: LockedTokenizer, vocab_size: int, vocabulary: Any = None,
                 tool_parser: str | None = None, eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id  # the model's end token: every request's decoding ends at it
        self.vocabulary = vocabulary  # core.decode.grammar.Vocabulary: grammars are checked against it
        template = getattr(getattr(tokenizer, "tokenizer", tokenizer), "chat_template", None)
        self.renders_tools = self._renders_tools()  # False: tools go into the system prompt (core.serve.tools)
        self.tool_parser = tool_parser or parser_for_template(template if isinstance(template, str) else None)

    def _renders_tools(self) -> bool:
        """Whether the chat template shows the model a tool it is given (many render only role and
        content: the built-in model's drops tools silently)."""
        probe = [{"type": "function", "function": {"name": "specx_probe_tool", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "hi"}]
        try:
            return self.chat(messages, probe) != self.chat(messages, None)
        except ApiError:
            return False

    def chat_tools(self, messages: list[dict[str, Any]], tools: Any, tool_choice: Any,
                   add_generation_prompt: bool = True) -> tuple[list[int], list[dict[str, Any]], ToolChoice]:
        """(prompt tokens, functions, choice) of a chat with the request's `tools` and `tool_choice`
        (validated: ApiError names the param): through the template when it renders tools, else
        with the tool schemas in the system prompt and the tool-call history as text (core.serve.tools)."""
        try:
            functions = check_tools(tools)
            choice = check_tool_choice(tool_choice, functions)
            offered = functions if choice.mode != "none" else []
            if self.renders_tools:
                return self.chat(messages, tools if offered else None, add_generation_prompt), functions, choice
            plain = messages_for_plain_template(self.tool_parser, messages, offered or None)
        except ToolsError as exc:
            raise ApiError(400, str(exc), exc.param, "invalid_value") from None
        return self.chat(plain, None, add_generation_prompt), functions, choice

    def grammar(self, grammar: str, param: str) -> str:
        """The grammar, once llguidance has compiled it against the model's vocabulary."""
        if self.vocabulary is None:
            raise ApiError(400, "constrained decoding is not available on this server", param,
                           "unsupported_parameter")
        try:
            self.vocabulary.check(grammar)
        except GrammarError as exc:
            raise ApiError(400, f"Invalid '{param}': {exc}", param, "invalid_value") from None
        return grammar

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             add_generation_prompt: bool = True) -> list[int]:
        try:
            return chat_tokens(self.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja errors, a template that rejects a role, ...
            raise ApiError(400, f"the model's chat template cannot render these messages: {exc}", "messages") from None

    def text(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))
