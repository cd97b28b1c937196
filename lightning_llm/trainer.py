"""A quiet single-process CPU ``Trainer`` for the library's own study helpers, tests and benchmarks, and the
CLI's step progress bar."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["QUIET_TRAINER_KWARGS", "StepProgressBar", "quiet_trainer"]

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


class StepProgressBar(TQDMProgressBar):
    """The CLI's progress bar: a step-bounded run (``max_steps > 0``) shows one bar of ``global_step`` out of
    ``max_steps`` across epochs and resumes (Lightning's counts batches of the current epoch, which reads ``0/-2``
    for an iterable loader and ``30/14`` after a resume); ``v_num`` is left out of the metrics."""

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_epoch_start(trainer, *args)
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # the first epoch of this fit: one bar for the whole run
            bar.reset(total=trainer.max_steps)
            bar.initial = 0
            bar.n = min(trainer.global_step, trainer.max_steps)
            bar.set_description("Step")
            bar.refresh()
        return None

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        n = min(trainer.global_step, trainer.max_steps)
        if self._should_update(n, trainer.max_steps):
            bar.n = n
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
        return None

    @override
    def get_metrics(
        self, trainer: L.Trainer, pl_module: L.LightningModule
    ) -> dict[str, int | str | float | dict]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
