"""Chat messages as a model reads them: the tokenizer's chat template (given at load, or its own),
a conversation's token ids, a logged prompt's text (ChatML-style turns when there is no template),
and whether a tokenizer's prompts are plain ChatML blocks that tokenize one message at a time
(store/prompts.py). core/model/load.py loads the tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .load import ModelError


def use_chat_template(tokenizer: Any, template: str | None, model: str) -> None:
    """Give `tokenizer` the chat template `template` (a file's path, or the Jinja template itself)
    and check that it renders a user turn; without one, ModelError unless the tokenizer has its own
    (a model without a template cannot take chat messages: say so at load, not at every request)."""
    if template is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(f"{model} has no chat template: pass --chat-template with a Jinja template or a file "
                             f"holding one (as in a tokenizer_config.json), or use raw completions")
        return
    if "{{" in template or "{%" in template:
        text = template
    else:
        path = Path(template).expanduser()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelError(f"--chat-template {template!r}: not a template and not a readable file "
                             f"({getattr(exc, 'strerror', None) or exc})") from None
    tokenizer.chat_template = text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - jinja raises anything
        raise ModelError(f"--chat-template cannot render a user message: {type(exc).__name__}: {exc}") from None


def chat_tokens(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages` through the tokenizer's chat template (with `tools` when given):
    apply_chat_template returns a list or, in some versions, a mapping holding "input_ids"."""
    kwargs = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
    """A logged prompt as the text the model would read: the tokenizer's chat template when it has
    one, ChatML-style turns otherwise. A plain-text prompt (role "prompt_text") is its text.
    `generation_prompt` adds what opens the assistant's turn (to have the model answer)."""
    if len(messages) == 1 and messages[0].get("role") == "prompt_text":
        return str(messages[0].get("content", ""))
    turns = [{"role": str(m.get("role") or "user"), "content": _content_text(m.get("content"))} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception:  # noqa: BLE001 - templates raise anything on odd role sequences; fall back
            pass
    return "".join(chatml_block(t) for t in turns) + ("<|im_start|>assistant\n" if generation_prompt else "")


def chatml_blocks(tokenizer: Any) -> str | None:
    """When the tokenizer renders prompts as plain ChatML turns, the text it puts before the first
    turn when that turn is not a system message (possibly ""); None when it renders otherwise.

    Then a prompt's text is that prefix (if due) followed by one block per message, each starting
    with a special token, so its tokens are the blocks' tokens concatenated: each distinct message
    can be tokenized once, however many calls resend it.
    """
    probe = [{"role": "system", "content": "s y"}, {"role": "user", "content": "u v"},
             {"role": "assistant", "content": "a b"}]
    blocks = [chatml_block(m) for m in probe]
    if render_prompt(tokenizer, probe) != "".join(blocks):
        return None
    alone = render_prompt(tokenizer, probe[1:])
    if not alone.endswith("".join(blocks[1:])):
        return None
    special = "<|im_start|>"
    if special not in tokenizer.get_vocab() or len(tokenizer.encode(special, add_special_tokens=False)) != 1:
        return None  # blocks must start with an unsplittable token for their tokens to concatenate
    return alone[: len(alone) - len("".join(blocks[1:]))]


def chatml_block(message: dict[str, Any]) -> str:
    return f"<|im_start|>{message.get('role') or 'user'}\n{_content_text(message.get('content'))}<|im_end|>\n"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)
