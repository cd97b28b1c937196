"""Supervised fine-tuning on chat-templated conversations, one per sequence or packed into blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_llm.datamodules.sources import ExampleDataModule, pad_sequences
from lightning_llm.types import IGNORE_INDEX, Example

__all__ = ["ChatSFTDataModule"]

_PACKINGS = ("none", "block")


class ChatSFTDataModule(ExampleDataModule):
    """Chat SFT batches: ``[system?, user=prompt, assistant=completion]`` rendered by the tokenizer's template.

    Only the assistant response and its end token are trained: every label up to and including the assistant
    header is ``-100``. The prompt is tokenized separately from the response, exactly as it is at generation
    time, so the trained tokens are the ones the model will have to produce. The response is trained up to and
    including the tokenizer's eos token, which ends an assistant turn in ChatML (Qwen) and Llama-3-Instruct
    templates; text the template writes after it (ChatML's newline) stays in the sequence untrained; a template
    that writes no eos gets one appended, so the model still learns to stop.

    Packing:

    - ``"none"``: one conversation per sequence, right-padded per batch to the longest (padding has label
      ``-100`` and attention mask 0). A conversation longer than ``max_length`` keeps its prompt and loses the
      end of its response; one whose prompt alone fills ``max_length`` is dropped. One warning counts both.
    - ``"block"``: all conversations (with their label masks) are concatenated into one stream and cut into
      ``block_size`` blocks: no padding, no truncation, the last partial block is dropped. Attention is plain
      causal over the whole block, so it deliberately *leaks across conversation boundaries*: this is "block
      training", the baseline FAST (arXiv 2506.07691) argues against for instruct models.

    Batch: ``dict(input_ids, attention_mask, labels)``, long tensors of shape ``[B, T]``.

    Args:
        packing: ``"none"`` (one conversation per sequence) or ``"block"`` (concatenate and cut into blocks).
        block_size: Block length for ``packing="block"`` (default: ``max_length``); at least 2.
        **kwargs: The arguments of :class:`~lightning_llm.datamodules.sources.ExampleDataModule`.
    """

    _required = ("prompt", "completion")

    def __init__(
        self, *, packing: Literal["none", "block"] = "none", block_size: int | None = None, **kwargs: Any
    ) -> None:
        if packing not in _PACKINGS:
            raise ValueError(f"unknown packing {packing!r}; choose one of {_PACKINGS}")
        if block_size is not None and packing != "block":
            raise ValueError(f"block_size only applies to packing='block', but packing={packing!r}")
        if block_size is not None and block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        super().__init__(**kwargs)

    @property
    def block_size(self) -> int:
        """Length of a packed block (``max_length`` unless ``block_size`` was given)."""
        return self.hparams.block_size or self.hparams.max_length

    def _build(self, train: list[Example], val: list[Example]) -> tuple[list[Any], list[Any]]:
        train_docs, val_docs = self._encode(train), self._encode(val)
        if self.hparams.packing == "block":
            return self._pack(train_docs, "train"), self._pack(val_docs, "validation")
        max_length = self.hparams.max_length
        train_items = [item for doc in train_docs if (item := self._truncate(*doc)) is not None]
        val_items = [item for doc in val_docs if (item := self._truncate(*doc)) is not None]
        cut = sum(len(ids) > max_length for ids, _ in train_docs + val_docs)
        if cut:
            dropped = len(train_docs) + len(val_docs) - len(train_items) - len(val_items)
            rank_zero_warn(
                f"{type(self).__name__}: {cut} of {len(train_docs) + len(val_docs)} conversations exceed "
                f"max_length={max_length} tokens and had their response cut; {dropped} of them were dropped "
                "because their prompt alone fills max_length"
            )
        if not train_items:
            raise ValueError(f"no training conversation fits in max_length={max_length} tokens")
        return train_items, val_items

    def _collator(self) -> _SFTCollator:
        return _SFTCollator(pad_id=self.tokenizer.pad_token_id)

    def _pack(self, docs: list[tuple[list[int], list[int]]], split: str) -> list[dict[str, torch.Tensor]]:
        if not docs:
            return []
        ids = torch.tensor([token for doc_ids, _ in docs for token in doc_ids])
        labels = torch.tensor([label for _, doc_labels in docs for label in doc_labels])
        blocks = len(ids) // self.block_size
        if blocks == 0:
            raise ValueError(
                f"the {split} conversations total {len(ids)} tokens, fewer than one block of "
                f"block_size={self.block_size}"
            )
        usable = blocks * self.block_size
        return [
            {"input_ids": block_ids, "labels": block_labels}
            for block_ids, block_labels in zip(
                ids[:usable].view(blocks, -1).unbind(), labels[:usable].view(blocks, -1).unbind(), strict=True
            )
        ]


@dataclass(frozen=True)
class _SFTCollator:
    """Right-pads items to the longest in the batch; padding is masked out of attention and loss."""

    pad_id: int

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = [item["input_ids"] for item in items]
        return {
            "input_ids": pad_sequences(input_ids, self.pad_id),
            "attention_mask": pad_sequences([torch.ones_like(ids) for ids in input_ids], 0),
            "labels": pad_sequences([item["labels"] for item in items], IGNORE_INDEX),
        }
