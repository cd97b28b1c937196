"""Calibration data for post-training callbacks (expert pruning, quantisation): one rule, shared."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from torch import Tensor

__all__ = ["calibration_batches", "check_calibration"]


def check_calibration(calibration: int | Sequence[str] | None, *, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``calibration`` is a batch count >= 1, a non-empty list of strings (or None)."""
    if calibration is None and allow_none:
        return
    if isinstance(calibration, bool) or not (
        (isinstance(calibration, int) and calibration >= 1)
        or (
            isinstance(calibration, Sequence)
            and not isinstance(calibration, str)
            and calibration
            and all(isinstance(text, str) for text in calibration)
        )
    ):
        raise ValueError("calibration must be a number of batches >= 1 or a non-empty list of strings")


def calibration_batches(
    trainer: L.Trainer, pl_module: L.LightningModule, calibration: int | Sequence[str]
) -> list[dict[str, Tensor]]:
    """The first ``calibration`` batches of the trainer's train dataloader, or the strings tokenized.

    Strings are tokenized one per batch with the LightningModule's ``tokenizer`` (no special tokens added).
    """
    if isinstance(calibration, int):
        loader = trainer.train_dataloader
        if loader is None:
            raise RuntimeError("calibration by batch count needs the trainer's train dataloader")
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == calibration:
                break
        return batches
    tokenizer = getattr(pl_module, "tokenizer", None)
    if tokenizer is None:
        raise RuntimeError("calibration strings need a `tokenizer` attribute on the LightningModule")
    return [dict(tokenizer(text, return_tensors="pt", add_special_tokens=False)) for text in calibration]
