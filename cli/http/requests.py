"""OpenAI API request bodies -> validated GenerationRequests, or ApiError (OpenAI-style 4xx).

Pure validation, no HTTP: app.py calls parse_request for each body; tokens.Tokenizers
turns what is valid into prompt tokens and grammars.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

from ..core.decode.grammar import GrammarError, json_schema_grammar
from ..core.decode.request import Decoding
from ..core.serve.tools import call_grammar
from ..core.serve.job import GenerationRequest

from .errors import ApiError
from .fields import bool_field, check_ids, int_field, is_ids, json_object, model_name, number_field
from .limits import PREDICTION_CHARS_PER_TOKEN, bound_chars, bound_ids, bound_prompt_chars, refuse_lone_surrogates

if TYPE_CHECKING:
    from .tokens import Tokenizers

MAX_N = 8
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # each stop string: kept with the answer, so bounded
MAX_NAME_CHARS = 256  # a message's name
MAX_MESSAGES_FIELDS_CHARS = 1024 * 1024  # all messages' fields other than content together (they are stored)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


def parse_request(body: Any, endpoint: str, model_names: list[str], context_length: int,
                  tokenizers: Tokenizers) -> tuple[GenerationRequest, bool, bool]:
    """(request, stream, include_usage) from a decoded JSON body, or ApiError."""
    body = json_object(body)
    refuse_lone_surrogates(body)
    tool_parser, tool_names, tools_grammar = None, None, None
    model = model_name(body, model_names, required=True)
    _refuse_unsupported(body, endpoint)
    stream = bool_field(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(stream_options, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = bool_field(stream_options, "include_usage", False, "stream_options.include_usage")
    n = int_field(body, "n", 1, 1, MAX_N)
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise ApiError(400, "Invalid 'top_p': must be greater than 0", "top_p", "invalid_value")
    top_k = int_field(body, "top_k", 0, -1, 1 << 31)  # a vLLM extension; -1 or 0 means all tokens
    seed = int_field(body, "seed", None, -(1 << 63), (1 << 63) - 1 - MAX_N)
    stop = _stop(body)
    if endpoint == "chat.completions":
        messages = _messages(body)
        bound_prompt_chars(messages, body.get("tools"), context_length)
        prompt_ids, functions, choice = tokenizers.chat_tools(messages, body.get("tools"), body.get("tool_choice"))
        prompt_messages, prompt_text, prompt_param = messages, None, "messages"
        if choice.mode in ("required", "named"):  # the output is calls: a grammar enforces them
            parallel = bool_field(body, "parallel_tool_calls", True)
            tools_grammar = tokenizers.grammar(call_grammar(tokenizers.tool_parser, functions, choice, parallel),
                                               "tools")
        if choice.mode != "none":
            tool_parser, tool_names = tokenizers.tool_parser, [f["name"] for f in functions]
    else:
        prompt_text, prompt_ids = _prompt(body, tokenizers, context_length)
        prompt_messages, prompt_param = None, "prompt"
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", prompt_param)
    room = context_length - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {context_length} tokens. However, your "
                            f"{prompt_param} resulted in {len(prompt_ids)} tokens. Please reduce the length of the "
                            f"{prompt_param}.", prompt_param, "context_length_exceeded")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if endpoint == "chat.completions" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    max_tokens = int_field(body, name, default, 1, None)
    if max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {context_length} tokens. However, you requested "
                            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {prompt_param}, "
                            f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} or "
                            f"completion.", name, "context_length_exceeded")
    prediction = _prediction(body, tokenizers, context_length)
    grammar, grammar_param = (tools_grammar, "tools") if tools_grammar else _response_format(body, tokenizers)
    settings = Decoding(max_new_tokens=max_tokens, eos_token_ids=tokenizers.eos_token_id, temperature=temperature,
                        top_p=top_p, top_k=max(top_k, 0), seed=seed, stop=stop, grammar=grammar,
                        logprobs=_logprobs(body, endpoint))
    prefix = "chatcmpl" if endpoint == "chat.completions" else "cmpl"
    request = GenerationRequest(id=f"{prefix}-{uuid.uuid4().hex[:24]}", endpoint=endpoint, model=model,
                                prompt_ids=prompt_ids, settings=settings, prompt_messages=prompt_messages,
                                prompt_text=prompt_text, n=n, prediction_ids=prediction, grammar_param=grammar_param,
                                tool_parser=tool_parser, tool_names=tool_names)
    return request, stream, include_usage


def parse_tokenize(body: Any, model_names: list[str], tokenizers: Tokenizers,
                   context_length: int | None = None) -> list[int]:
    """POST /tokenize (vLLM's): {"model"?, "prompt"} or {"model"?, "messages", "add_generation_prompt"?,
    "tools"?} -> the token ids the completion endpoints would feed the model, or ApiError. With
    `context_length`, text longer than PROMPT_CHARS_PER_TOKEN per context token is refused untokenized."""
    body = json_object(body)
    refuse_lone_surrogates(body)
    model_name(body, model_names, required=False)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a list of message objects", "messages", "invalid_type")
        if context_length:
            bound_prompt_chars(messages, body.get("tools"), context_length)
        return tokenizers.chat_tools(messages, body.get("tools"), body.get("tool_choice"),
                                     bool_field(body, "add_generation_prompt", True))[0]
    if isinstance(body.get("prompt"), str):
        if context_length:
            bound_chars("prompt", len(body["prompt"]), context_length)
        return tokenizers.text(body["prompt"])
    raise ApiError(400, "give 'prompt' (a string) or 'messages'", "prompt", "missing_required_parameter")


def parse_detokenize(body: Any, model_names: list[str], vocab_size: int, context_length: int | None = None) -> list[int]:
    """POST /detokenize (vLLM's): {"model"?, "tokens": [ids]} -> the ids, checked, or ApiError;
    with `context_length`, more ids than that are refused undecoded (limits.bound_ids)."""
    body = json_object(body)
    if context_length and isinstance(body.get("tokens"), list):
        bound_ids("tokens", len(body["tokens"]), context_length)
    refuse_lone_surrogates(body)
    model_name(body, model_names, required=False)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not is_ids(tokens):
        raise ApiError(400, "'tokens' must be a list of token ids (integers)", "tokens", "invalid_type")
    check_ids(tokens, vocab_size, "tokens")
    return tokens


def _prediction(body: dict[str, Any], tokenizers: Tokenizers, context_length: int) -> list[int] | None:
    """OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts} as token ids, at
    most `context_length` of them (a longer one could never be the output: refused, not truncated)."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise ApiError(400, "'prediction' must be {\"type\": \"content\", \"content\": ...}", "prediction",
                       "invalid_value")
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "'prediction.content' must be a string or an array of text parts", "prediction.content",
                       "invalid_type")
    too_long = ApiError(400, f"'prediction.content' is longer than the model's context ({context_length} tokens)",
                        "prediction.content", "context_length_exceeded")
    if len(content) > PREDICTION_CHARS_PER_TOKEN * context_length:  # refused before the tokenizer's memory is spent
        raise too_long
    ids = tokenizers.text(content) if content else None
    if ids and len(ids) > context_length:
        raise too_long
    return ids


MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (completions: 5; vLLM allows more, so does specx: 20)


def _logprobs(body: dict[str, Any], endpoint: str) -> int:
    """How many top alternatives to report with each token's log-probability (-1: no logprobs).
    Chat: logprobs (boolean) and top_logprobs; completions: logprobs (an integer)."""
    if endpoint == "completions":
        return int_field(body, "logprobs", -1, 0, MAX_TOP_LOGPROBS)
    top = int_field(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if not bool_field(body, "logprobs", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return -1
    return top or 0


SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _response_format(body: dict[str, Any], tokenizers: Tokenizers) -> tuple[str | None, str | None]:
    """OpenAI's response_format as (grammar, the param it came from): None for text; any JSON object
    for json_object; JSON that matches the schema for json_schema (decoding is constrained, so
    `strict` or not, the output follows the schema)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None, None
    if not isinstance(fmt, dict):
        raise ApiError(400, "'response_format' must be an object", "response_format", "invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return tokenizers.grammar(json_schema_grammar(None), "response_format"), "response_format"
    if kind != "json_schema":
        raise ApiError(400, f"Invalid value for 'response_format.type': {kind!r}; expected text, json_object or "
                            "json_schema", "response_format.type", "invalid_value")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "Missing required parameter: 'response_format.json_schema'.", "response_format.json_schema",
                       "missing_required_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise ApiError(400, "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                       "response_format.json_schema.name", "invalid_value")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                       "response_format.json_schema.schema", "invalid_type")
    bool_field(spec, "strict", False, "response_format.json_schema.strict")
    param = "response_format.json_schema.schema"
    try:
        grammar = json_schema_grammar(schema or {})
    except GrammarError as exc:  # e.g. nested deeper than the schema compiler goes
        raise ApiError(400, f"Invalid '{param}': {exc}", param, "invalid_value") from None
    return tokenizers.grammar(grammar, param), param


def _refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Parameters whose meaning specx cannot honour get a 400 rather than being silently ignored."""
    def present(name: str) -> bool:  # set to something other than its neutral value
        return body.get(name) not in (None, False, 0)

    for name in ("presence_penalty", "frequency_penalty"):
        if present(name):
            raise ApiError(400, f"'{name}' is not supported by specx serve (only 0)", name, "unsupported_parameter")
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported by specx serve", "logit_bias", "unsupported_parameter")
    if endpoint == "completions":
        if present("echo"):
            raise ApiError(400, "'echo' is not supported by specx serve", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise ApiError(400, "'suffix' (insertion) is not supported by specx serve", "suffix",
                           "unsupported_parameter")
        best_of = body.get("best_of")
        if best_of not in (None, 1) and best_of != body.get("n", 1):
            raise ApiError(400, "'best_of' is not supported by specx serve", "best_of", "unsupported_parameter")


# The message fields chat templates read; others (client metadata, ids) are neither rendered nor stored.
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
MAX_FIELDS_CHARS = 256 * 1024  # a message's name, tool calls and tool call id together


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages", "invalid_type")
    out = []
    fields_chars = 0
    for i, message in enumerate(messages):
        param = f"messages.[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"Invalid type for '{param}': expected an object", param, "invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"Invalid value for '{param}.role': {role!r}; expected one of {', '.join(CHAT_ROLES)}",
                           f"{param}.role", "invalid_value")
        content = message.get("content")
        if content is None:
            if role not in ("assistant", "function", "tool"):
                raise ApiError(400, f"Missing required parameter: '{param}.content'.", f"{param}.content",
                               "missing_required_parameter")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "refusal") \
                        or not isinstance(part.get(part.get("type")), str):
                    raise ApiError(400, f"'{param}.content[{j}]': only text content parts are supported",
                                   f"{param}.content", "unsupported_content")
                texts.append(part[part["type"]])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ApiError(400, f"Invalid type for '{param}.content': expected a string or an array of text parts",
                           f"{param}.content", "invalid_type")
        kept = {k: message[k] for k in MESSAGE_FIELDS if k in message}  # what a template can render: stored too
        extra = len(json.dumps({k: v for k, v in kept.items() if k != "content"}, default=str))
        if extra > MAX_FIELDS_CHARS:
            raise ApiError(400, f"'{param}': its fields other than content take {extra:,} characters (at most "
                                f"{MAX_FIELDS_CHARS:,})", param, "message_too_large")
        name = kept.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_CHARS):
            raise ApiError(400, f"Invalid '{param}.name': expected a string of at most {MAX_NAME_CHARS} characters",
                           f"{param}.name", "invalid_value")
        fields_chars += extra
        if fields_chars > MAX_MESSAGES_FIELDS_CHARS:
            raise ApiError(400, f"'messages': their fields other than content take more than "
                                f"{MAX_MESSAGES_FIELDS_CHARS:,} characters together", param, "message_too_large")
        out.append({**kept, "content": content})
    return out


def _prompt(body: dict[str, Any], tokenizers: Tokenizers, context_length: int) -> tuple[str, list[int]]:
    """The completions prompt: a string, or token ids; a list of one of those is one prompt too."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        bound_chars("prompt", len(prompt), context_length)
        return prompt, tokenizers.text(prompt)
    if isinstance(prompt, list) and prompt and is_ids(prompt):
        check_ids(prompt, tokenizers.vocab_size, "prompt")
        return tokenizers.tokenizer.decode(prompt), list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request (send several requests, or use n)", "prompt",
                       "unsupported_parameter")
    raise ApiError(400, "'prompt' must be a string or an array of token ids", "prompt", "invalid_type")


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP} non-empty strings", "stop", "invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"each 'stop' string may be at most {MAX_STOP_CHARS:,} characters", "stop", "invalid_value")
    return stops
