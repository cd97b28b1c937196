"""Prompts for reinforcement learning: rendered for generation, carrying the examples that rewards score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_llm.datamodules.sources import ExampleDataModule, pad_sequences
from lightning_llm.types import Example

__all__ = ["PromptDataModule"]


class PromptDataModule(ExampleDataModule):
    """Prompt batches for on-policy RL (GRPO and friends).

    Each prompt is rendered as ``[system?, user=prompt]`` with ``add_generation_prompt=True``, i.e. ending in
    the assistant header, and tokenized as the policy will continue it. Prompts are LEFT-padded, so that every
    row's last position is its last prompt token and generation appends to all rows in lockstep. Prompts longer
    than ``max_length`` tokens are dropped (cutting one would change the question), with one warning.

    The :class:`~lightning_llm.datamodules.tasks.Example` objects travel in the batch so that reward functions
    can check answers and read metadata; the validation loader yields the same objects every epoch. A real
    source needs only a prompt column (an answer column is optional, ``""`` when absent).

    Batch: ``dict(input_ids [B, P] long, attention_mask [B, P] long, prompt: list[str] (the rendered text),
    example: list[Example])``.

    Args:
        **kwargs: The arguments of :class:`~lightning_llm.datamodules.sources.ExampleDataModule`.
    """

    _required = ("prompt",)

    def _build(self, train: list[Example], val: list[Example]) -> tuple[list[Any], list[Any]]:
        max_length = self.hparams.max_length
        train_items, val_items = self._items(train), self._items(val)
        dropped = len(train) + len(val) - len(train_items) - len(val_items)
        if dropped:
            rank_zero_warn(
                f"{type(self).__name__}: dropped {dropped} of {len(train) + len(val)} prompts longer than "
                f"max_length={max_length} tokens"
            )
        if not train_items:
            raise ValueError(f"no training prompt fits in max_length={max_length} tokens")
        return train_items, val_items

    def _items(self, examples: list[Example]) -> list[dict[str, Any]]:
        """One item per example whose rendered prompt fits in ``max_length`` tokens."""
        texts = [self._render_prompt(example.prompt) for example in examples]
        return [
            {"input_ids": torch.tensor(ids), "prompt": text, "example": example}
            for example, text, ids in zip(examples, texts, self._tokenize(texts), strict=True)
            if len(ids) <= self.hparams.max_length
        ]

    def _collator(self) -> _PromptCollator:
        return _PromptCollator(pad_id=self.tokenizer.pad_token_id)


@dataclass(frozen=True)
class _PromptCollator:
    """Left-pads the prompts; passes the rendered text and the examples through as lists."""

    pad_id: int

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids = [item["input_ids"] for item in items]
        return {
            "input_ids": pad_sequences(input_ids, self.pad_id, left=True),
            "attention_mask": pad_sequences([torch.ones_like(ids) for ids in input_ids], 0, left=True),
            "prompt": [item["prompt"] for item in items],
            "example": [item["example"] for item in items],
        }
