"""A quiet single-process CPU ``Trainer`` for the library's own study helpers, tests and benchmarks."""

from __future__ import annotations

from typing import Any

import lightning as L

__all__ = ["QUIET_TRAINER_KWARGS", "quiet_trainer"]

#: No logger, progress bar, model summary, checkpoints, sanity check or validation; one CPU process.
QUIET_TRAINER_KWARGS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def quiet_trainer(max_steps: int = -1, **overrides: Any) -> L.Trainer:
    """``L.Trainer(max_steps=..., **QUIET_TRAINER_KWARGS)`` with ``overrides`` applied on top."""
    return L.Trainer(**{"max_steps": max_steps, **QUIET_TRAINER_KWARGS, **overrides})
