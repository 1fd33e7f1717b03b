"""OpenAI tool calls without HTTP or a model: validating `tools` and `tool_choice`, the prompt that
lists the tools, tool-call history as text for a chat template that renders only role and
content, and the grammar that forces a call. The output formats (hermes, llama3_json, mistral),
and the calls read from an output, are core/serve/tool_calls.py's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..decode.grammar import lark_grammar
from .tool_calls import PARSERS, check_parser, dumps, loads

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_DEFAULT_PARAMETERS = {"type": "object", "properties": {}}
_RESULTS = {"hermes": "<tool_response>\n{}\n</tool_response>", "mistral": "[TOOL_RESULTS]{}[/TOOL_RESULTS]"}


class ToolsError(ValueError):
    """An invalid `tools`, `tool_choice` or tool-call message; `param` is the OpenAI param path
    ("tools[0].function.name", "tool_choice", ...) the server reports with its HTTP 400."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """A validated `tool_choice`: mode "none", "auto", "required" or "named" (then `name`)."""

    mode: str
    name: str | None = None


# ---------------------------------------------------------------------------------- validation

def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ToolsError(param, message)


def check_tools(tools: Any) -> list[dict]:
    """The function dicts ({"name", "description"?, "parameters"}) of an OpenAI `tools` array;
    None or [] means no tools. ToolsError names the first invalid param."""
    _require(tools is None or isinstance(tools, list), "tools", "'tools' must be an array of tool objects")
    functions: list[dict] = []
    for i, tool in enumerate(tools or []):
        at = f"tools[{i}]"
        _require(isinstance(tool, dict), at, f"'{at}' must be an object")
        _require(tool.get("type") == "function", f"{at}.type", f"'{at}.type' must be 'function'")
        fn = tool.get("function")
        _require(isinstance(fn, dict), f"{at}.function", f"'{at}.function' must be an object")
        at += ".function"
        name, description, parameters = fn.get("name"), fn.get("description"), fn.get("parameters")
        _require(isinstance(name, str) and bool(_NAME.fullmatch(name)), f"{at}.name",
                 f"'{at}.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
        _require(all(f["name"] != name for f in functions), f"{at}.name", f"duplicate function name {name!r}")
        _require(description is None or isinstance(description, str), f"{at}.description",
                 f"'{at}.description' must be a string")
        parameters = _DEFAULT_PARAMETERS if parameters is None else parameters
        _require(isinstance(parameters, dict) and parameters.get("type", "object") == "object", f"{at}.parameters",
                 f"'{at}.parameters' must be a JSON schema of type 'object'")
        _require(fn.get("strict") is None or isinstance(fn["strict"], bool), f"{at}.strict",
                 f"'{at}.strict' must be a boolean")
        description = {} if description is None else {"description": description}
        functions.append({"name": name, **description, "parameters": dict(parameters)})
    return functions


def check_tool_choice(choice: Any, functions: list[dict]) -> ToolChoice:
    """Validate an OpenAI `tool_choice` against the tools; absent: "auto" with tools, else "none"."""
    if choice is None or choice == "none":
        return ToolChoice("auto" if functions and choice is None else "none")
    _require(bool(functions), "tool_choice", "'tool_choice' other than 'none' needs 'tools'")
    if choice in ("auto", "required"):
        return ToolChoice(choice)
    _require(isinstance(choice, dict), "tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
             "{'type': 'function', 'function': {'name': ...}}")
    _require(choice.get("type") == "function", "tool_choice.type", "'tool_choice.type' must be 'function'")
    fn = choice.get("function")
    _require(isinstance(fn, dict), "tool_choice.function", "'tool_choice.function' must be an object")
    name = fn.get("name")
    _require(any(f["name"] == name for f in functions), "tool_choice.function.name",
             f"'tool_choice' names {name!r}, which is not in 'tools'")
    return ToolChoice("named", name)


def parser_for_template(template: str | None) -> str:
    """The parser whose format a chat template's source writes (hermes when it shows none)."""
    for marker, parser in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                           ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json")):
        if marker in (template or ""):
            return parser
    return "hermes"


# ---------------------------------------------------------------------------------- prompts

def tools_system_prompt(parser: str, functions: list[dict]) -> str:
    """Instructions listing the tool schemas and how to call them in `parser`'s format."""
    check_parser(parser)
    tools = [{"type": "function", "function": fn} for fn in functions]
    if parser == "hermes":  # as Qwen2.5's and NousResearch Hermes' chat templates write it
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                + "".join(dumps(t) + "\n" for t in tools) + "</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    if parser == "llama3_json":  # the Llama 3.1 template's JSON-based tool calling prompt
        return ("Given the following functions, please respond with a JSON for a function call with its "
                "proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name '
                'and its value}. Do not use variables. To call several functions, separate the JSON objects '
                'with "; ". When you call a function, respond with the JSON only.\n\n'
                + "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)).rstrip()
    return ("[AVAILABLE_TOOLS]" + dumps(tools) + "[/AVAILABLE_TOOLS]\n"
            "To call one or more of these tools, answer with [TOOL_CALLS] followed by a JSON array of calls:\n"
            '[TOOL_CALLS][{"name": <tool-name>, "arguments": <args-json-object>}]')


def _text(content: Any) -> str:
    """A message content as text (None: "", OpenAI content parts: their text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


def _calls_text(parser: str, calls: list[tuple[str, Any]]) -> str:
    """(name, arguments object) pairs as `parser`'s call text (what call_grammar admits)."""
    if parser == "hermes":
        return "\n".join("<tool_call>\n" + dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls)
    if parser == "llama3_json":
        return "; ".join(dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a} for n, a in calls])


def _history_calls(tool_calls: Any, at: str) -> list[tuple[str, Any]]:
    """(name, arguments object) of an assistant message's OpenAI `tool_calls`."""
    _require(isinstance(tool_calls, list), at, f"'{at}' must be an array")
    calls = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        _require(isinstance(fn, dict) and isinstance(fn.get("name"), str), f"{at}[{j}].function",
                 f"'{at}[{j}].function' must be an object with a name")
        arguments = fn.get("arguments") or "{}"
        arguments = loads(arguments) if isinstance(arguments, str) else arguments
        _require(arguments is not None, f"{at}[{j}].function.arguments", f"'{at}[{j}].function.arguments' is not JSON")
        calls.append((fn["name"], arguments))
    return calls


def messages_for_plain_template(parser: str, messages: list[dict], functions: list[dict] | None) -> list[dict]:
    """New messages ({"role", "content"} only) for a template that renders role and content: the
    tools prompt goes before the first message's content when that is a system message (else in a
    new system message first), assistant `tool_calls` become call text after the content, and
    (consecutive) tool results become one user message. The input is not changed."""
    check_parser(parser)
    sep = "" if parser == "mistral" else "\n"
    out: list[dict] = []
    after_tool = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ToolsError(f"messages[{i}]", f"'messages[{i}]' must be an object")
        role, content = msg.get("role"), msg.get("content")
        if role == "tool":
            result = _RESULTS.get(parser, "{}").format(_text(content))
            if after_tool:
                out[-1]["content"] += sep + result
            else:
                out.append({"role": "user", "content": result})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and msg.get("tool_calls"):
            calls = _calls_text(parser, _history_calls(msg["tool_calls"], f"messages[{i}].tool_calls"))
            content = _text(content) + sep + calls if _text(content) else calls
        out.append({"role": role, "content": content})
    if functions:
        prompt = tools_system_prompt(parser, functions)
        if out and out[0]["role"] == "system":
            system = _text(out[0]["content"])
            out[0] = {"role": "system", "content": prompt + "\n\n" + system if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---------------------------------------------------------------------------------- grammar

def _call_schema(fn: dict, key: str) -> dict:
    """The JSON schema of one call of `fn`: {"name": const, key: its parameters}, nothing else."""
    parameters = dict(fn.get("parameters") or _DEFAULT_PARAMETERS)
    parameters.setdefault("type", "object")
    schema: dict = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: parameters},
                    "required": ["name", key], "additionalProperties": False}
    for defs in ("$defs", "definitions"):  # "#/$defs/..." refs resolve from the root
        if defs in parameters:
            schema[defs] = parameters.pop(defs)
    schema["x-guidance"] = _JSON_OPTIONS  # compact JSON, as core.decode.grammar.json_schema_grammar
    return schema


def call_grammar(parser: str, functions: list[dict], choice: ToolChoice, parallel: bool = True) -> str:
    """An llguidance grammar whose texts are tool calls only, in `parser`'s format: one or more
    calls of any function ("required"; one when not `parallel`), or exactly one call of
    `choice.name` ("named"). The markers are plain text (a tokenizer's special [TOOL_CALLS] token
    is not admitted)."""
    check_parser(parser)
    if choice.mode not in ("required", "named"):
        raise ValueError(f"no grammar forces tool_choice {choice.mode!r}: only 'required' or a named function")
    chosen = [fn for fn in functions if choice.mode == "required" or fn["name"] == choice.name]
    _require(bool(chosen), "tool_choice.function.name" if choice.name else "tool_choice",
             f"'tool_choice' {choice.name or choice.mode!r} has no function in 'tools'")
    many = choice.mode == "required" and parallel  # parallel_tool_calls false: one call
    key = "parameters" if parser == "llama3_json" else "arguments"
    if parser == "hermes":
        rules = ['start: call ("\\n" call)*' if many else "start: call", 'call: "<tool_call>\\n" fn "\\n</tool_call>"']
    elif parser == "mistral":
        rules = ['start: "[TOOL_CALLS][" fn ("," " "? fn)* "]"' if many else 'start: "[TOOL_CALLS][" fn "]"']
    else:
        rules = ['start: fn ("; " fn)*' if many else "start: fn"]
    rules.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(chosen))))
    rules += [f"fn_{i}: %json {json.dumps(_call_schema(fn, key))}" for i, fn in enumerate(chosen)]
    return lark_grammar("\n".join(rules) + "\n")
