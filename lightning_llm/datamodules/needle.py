"""Chat SFT on long-context retrieval tasks (associative recall, needles), for KV-cache eviction studies."""

from __future__ import annotations

from typing import Any

from lightning_llm.datamodules.chat_sft import ChatSFTDataModule
from lightning_llm.datamodules.tasks.long_context import LONG_CONTEXT_TASKS

__all__ = ["NeedleDataModule"]


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
