"""Small context managers every backbone user shares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["eval_mode", "quiet_progress"]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run a block with ``model`` in eval mode (no dropout), restoring its train/eval mode afterwards, also on errors.

    Generation and measurements (probes, metrics) call this so that they can run in the middle of training.
    """
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def quiet_progress(quiet: bool = True) -> Iterator[None]:
    """Hide transformers' progress bars (weight loading, shard writing) inside the block when ``quiet``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()
