"""The token ids that end a model's turn: its stop set, one list every generation and mask uses.

Instruct models often end an answer with a token that is not the tokenizer's eos: Gemma's ``<end_of_turn>``,
Qwen's ``<|im_end|>`` beside ``<|endoftext|>``, Llama 3's ``<|eot_id|>``. Their ``generation_config`` lists
those ids, and their chat template closes every turn with one. Stopping on the tokenizer's eos alone lets a
completion run past the end of its answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["end_of_turn_token_id", "stop_token_ids", "turn_end_token_id"]

#: Rendered as an assistant message to find what the chat template writes right after a turn's content.
_MARKER = "LIGHTNINGLLMENDOFTURNMARKER"


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, or None.

    The template renders a user and an assistant message; the text right after the assistant's content must
    start with a special added token (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``, ``</s>``); the longest
    such token is the end of turn. None when the tokenizer has no chat template, the template fails on that
    conversation, or the turn ends with ordinary text (a newline) or with several tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARKER}]
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (
        TemplateError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
    ):  # a template may refuse this conversation
        return None
    if not isinstance(text, str) or _MARKER not in text:
        return None
    after = text[text.rindex(_MARKER) + len(_MARKER) :]
    special = [
        (len(token.content), index)
        for index, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content and after.startswith(token.content)
    ]
    return max(special)[1] if special else None


def turn_end_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The token a trained response ends with: the chat template's end of turn, else the tokenizer's eos.

    What a model's turn ends with when rendered by its own template (Gemma's ``<end_of_turn>``, not its
    ``<eos>``), so a model trained on it stops where its stop set (:func:`stop_token_ids`) stops it.
    """
    end = end_of_turn_token_id(tokenizer)
    return tokenizer.eos_token_id if end is None else end


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: Any | None = None) -> list[int]:
    """The model's stop set: ids that end a completion, deduplicated, in a fixed order.

    The tokenizer's eos first, then every id of the generation config's ``eos_token_id`` (an int or a list)
    in its order, then the chat template's end-of-turn token (:func:`end_of_turn_token_id`). ``model`` is a
    model (its ``generation_config`` is read) or a ``GenerationConfig``; without it the set comes from the
    tokenizer alone (what a DataModule, which holds no model, can know). Empty only when none is known.
    """
    config = getattr(model, "generation_config", model)
    found = [
        *_ids(tokenizer.eos_token_id),
        *_ids(getattr(config, "eos_token_id", None)),
        *_ids(end_of_turn_token_id(tokenizer)),
    ]
    return list(dict.fromkeys(found))
