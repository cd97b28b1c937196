"""Long-context retrieval for KV-cache eviction: chat SFT on the tasks (associative recall, needles) and the
prose needle prompts a pretrained chat model is scored on.

:func:`needle_examples` draws prose-filler needle prompts (single needles spread evenly over :data:`DEPTHS`,
or four facts with one asked), :func:`encode_chat_prompts` renders them with the chat template under
:data:`NEEDLE_SYSTEM_PROMPT`, and :func:`first_number_score` scores a completion by its first number (SmolLM2
answers "The code for X is 1234", not the task's answer format).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.datamodules.tasks.long_context import LONG_CONTEXT_TASKS, MultiKeyNeedleTask, NeedleTask
from lightning_llm.types import Example

__all__ = [
    "DEPTHS",
    "NEEDLE_SYSTEM_PROMPT",
    "NeedleDataModule",
    "encode_chat_prompts",
    "first_number_score",
    "nearest_depth",
    "needle_examples",
]

NEEDLE_SYSTEM_PROMPT = "Answer the question about the text with the number only."
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_NUMBER = re.compile(r"[0-9]+")


class NeedleDataModule(ChatSFTDataModule):
    """Chat SFT batches of a long-context task: ``associative_recall`` (default), ``needle``, ``multikey_needle``.

    :class:`~lightning_llm.datamodules.chat_sft.ChatSFTDataModule` restricted to the tasks of
    :mod:`~lightning_llm.datamodules.tasks.long_context`, whose examples record where their needle is
    (``metadata["needle_char_start"]``, ``["needle_depth"]``) so that an evaluation of KV-cache eviction can
    bucket accuracy by depth; :attr:`num_context_tokens` gives the prompt lengths in tokens after
    :meth:`setup` (a KV budget of 25% is a fraction of these).

    Training the tiny backbone on these tasks, with measured steps, time and accuracy: see
    :class:`~lightning_llm.datamodules.tasks.long_context.AssociativeRecallTask`.

    Args:
        task: One of ``"associative_recall"``, ``"needle"``, ``"multikey_needle"``.
        **kwargs: The other arguments of :class:`~lightning_llm.datamodules.chat_sft.ChatSFTDataModule`
            (``task_kwargs``, ``num_train``, ``batch_size``, ``max_length``...); not a real ``source``.
    """

    def __init__(self, *, task: str | None = "associative_recall", **kwargs: Any) -> None:
        if task not in LONG_CONTEXT_TASKS:
            raise ValueError(
                f"{type(self).__name__} needs a long-context task, one of {LONG_CONTEXT_TASKS}; got {task!r} "
                "(use ChatSFTDataModule for other tasks or a real source)"
            )
        super().__init__(task=task, **kwargs)
        self._context_tokens: list[int] | None = None

    @property
    def num_context_tokens(self) -> dict[str, float]:
        """``{"mean", "max", "min"}`` of the chat-templated prompt lengths in tokens (train and validation).

        The prompt is rendered as at generation time (with the system prompt, up to the assistant header).
        Available after :meth:`setup`.
        """
        if self._context_tokens is None:
            if self._val_examples is None:
                raise RuntimeError(
                    f"{type(self).__name__}: call setup() before asking for num_context_tokens"
                )
            raise RuntimeError(f"{type(self).__name__}: no prompt lengths recorded")
        lengths = self._context_tokens
        return {"mean": sum(lengths) / len(lengths), "max": float(max(lengths)), "min": float(min(lengths))}

    def _build(self, train: list[Any], val: list[Any]) -> tuple[list[Any], list[Any]]:
        prompts = [self._render_prompt(example.prompt) for example in [*train, *val]]
        self._context_tokens = [len(ids) for ids in self._tokenize(prompts)]
        return super()._build(train, val)


def first_number_score(completion: str, example: Example) -> float:
    """1.0 when the first run of digits in ``completion`` is exactly ``example.answer``."""
    match = _NUMBER.search(completion)
    return float(match is not None and match.group(0) == example.answer)


def needle_examples(task: str, n: int, words: int, seed: int) -> list[Example]:
    """``n`` prose-filler examples of ``task``: ``"needle"`` (spread evenly over :data:`DEPTHS`, rounded up per
    depth) or ``"multikey_needle"`` (four facts, one asked), ``words`` filler words each, drawn from ``seed``."""
    if task == "needle":
        per_depth = math.ceil(n / len(DEPTHS))
        examples = []
        for index, depth in enumerate(DEPTHS):
            examples += NeedleTask(haystack_words=words, depth=depth, filler="prose").generate(
                per_depth, seed + 1000 * index
            )
        return examples[:n]
    return MultiKeyNeedleTask(haystack_words=words, num_needles=4, filler="prose").generate(n, seed)


def encode_chat_prompts(
    tokenizer: Any, examples: Sequence[Example], system_prompt: str | None = NEEDLE_SYSTEM_PROMPT
) -> list[list[int]]:
    """Token ids of each example's prompt rendered with the chat template under ``system_prompt``."""
    return [
        tokenizer(render_prompt(tokenizer, ex.prompt, system_prompt), add_special_tokens=False)["input_ids"]
        for ex in examples
    ]


def nearest_depth(example: Example) -> float:
    """The requested depth of a needle example (its measured depth rounded to the nearest of :data:`DEPTHS`)."""
    return min(DEPTHS, key=lambda d: abs(d - float(example.metadata["needle_depth"])))
