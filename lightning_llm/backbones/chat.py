"""Chat templates, including those without a system role: the system text is folded into the first user turn.

Some templates have no system role. Gemma's writes a system message's text at the start of the first user turn
itself; others raise on a system message (Gemma 2's ``raise_exception('System role not supported')``), or
render the conversation without it. :func:`apply_chat_template` renders through the template as it is when the
template keeps every system text, and otherwise folds the system text into the first user message (joined by a
blank line, as Gemma's own template does), so a task's instructions are never silently lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["apply_chat_template", "fold_system_messages", "keeps_system_messages"]

#: System text of the probe conversation: a template keeps system messages when it renders this string.
_PROBE = "LIGHTNINGLLMSYSTEMPROBE"


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without system messages, their texts (in order) prefixed to the first user message.

    Raises ``ValueError`` when there are system messages but no user message after them to carry the text.
    """
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not system:
        return rest
    for message in rest:
        if message["role"] == "user":
            message["content"] = "\n\n".join([*system, message["content"]])
            return rest
    raise ValueError("a conversation with a system message needs a user message to fold it into")


#: Chat template text -> whether it keeps system messages (rendering the probe once per template).
_KEEPS_SYSTEM: dict[str, bool] = {}


def keeps_system_messages(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer``'s chat template renders a system message's text (without raising)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; give it one "
            "(tokenizer.chat_template = ...) before rendering chat prompts"
        )
    if template not in _KEEPS_SYSTEM:
        from jinja2 import TemplateError

        probe = [{"role": "system", "content": _PROBE}, {"role": "user", "content": "hi"}]
        try:
            rendered = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
            _KEEPS_SYSTEM[template] = isinstance(rendered, str) and _PROBE in rendered
        except (TemplateError, ValueError, TypeError, KeyError, IndexError):  # "System role not supported"
            _KEEPS_SYSTEM[template] = False
    return _KEEPS_SYSTEM[template]


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
) -> str:
    """``messages`` rendered as text by ``tokenizer``'s chat template, system messages folded where it has no
    system role (see the module). Every prompt the library renders goes through here."""
    if any(m["role"] == "system" for m in messages) and not keeps_system_messages(tokenizer):
        messages = fold_system_messages(messages)
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
