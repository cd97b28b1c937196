"""Ctrl-C (SIGINT) and SIGTERM (preemption) end a fit with a resumable checkpoint of the last completed step."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["InterruptCheckpoint"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _validation_follows(trainer: L.Trainer) -> bool:
    """Whether Lightning runs a validation after the training batch that just ended (its own predicate)."""
    loop = trainer.fit_loop
    check = getattr(loop.epoch_loop, "_should_check_val_fx", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    return bool(check(fetcher)) if check is not None and fetcher is not None else False


class InterruptCheckpoint(Callback):
    """On SIGINT or SIGTERM during ``fit``, save a checkpoint at the next point Lightning resumes from exactly, and
    exit.

    The signal only sets a flag. The checkpoint is written by ``trainer.save_checkpoint`` at the end of the
    current training step (``on_train_batch_end``, where ``ModelCheckpoint(every_n_train_steps=...)`` saves) or,
    when a validation is due after that step, at the end of that validation (``on_validation_end``, where
    ``ModelCheckpoint`` saves after validating): Lightning skips the validation of a step saved at its batch end,
    so saving there would drop it from the resumed run. ``--ckpt_path`` then resumes with the next batch, and no
    finished step (or validation) is lost. A signal that arrives during a validation is acted on after the
    following training step. Once the step's metrics are logged, the fit stops at the next batch's start (or at
    ``on_train_end`` when it was the last): one line is printed (where the checkpoint is, and
    :attr:`resume_command` with ``--ckpt_path`` when one is set) and ``SystemExit(128 + signal)`` (130 for
    Ctrl-C, 143 for SIGTERM) goes through Lightning's exception path, so no validation is added and
    ``on_fit_end`` exports do not run. A second Ctrl-C before that interrupts at once, without a checkpoint
    (Python's default).

    The handlers are installed at ``on_train_start`` (after Lightning's own SIGTERM handler, which they replace
    for the fit: Lightning would stop in the middle of a validation) and restored when training ends; only the
    main thread can install them, elsewhere the callback does nothing. Under DDP every rank must receive the
    signal (a scheduler's SIGTERM does).

    Args:
        dirpath: directory of the checkpoint; default: the ``ModelCheckpoint``'s ``dirpath`` when the trainer has
            one, else ``<default_root_dir>/checkpoints``.
        filename: file name without the ``.ckpt`` extension.
        resume_command: the command that resumes the run without its ``--ckpt_path`` (the CLI sets it); the exit
            line appends ``--ckpt_path <file>`` to it.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str = "interrupted",
        resume_command: str | None = None,
    ) -> None:
        if not filename:
            raise ValueError("InterruptCheckpoint: filename must not be empty")
        self.dirpath = None if dirpath is None else str(dirpath)
        self.filename = filename
        self.resume_command = resume_command
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._saved: str | None = None
        self._after_validation = False

    def ckpt_path(self, trainer: L.Trainer) -> str:
        """Where the checkpoint of an interrupted fit of ``trainer`` is written."""
        directory = self.dirpath
        if directory is None:
            saving = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]
            directory = saving[0].dirpath if saving else None
        if directory is None:
            directory = os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(directory, self.filename + self.FILE_EXTENSION)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.received = signum

    def _save(self, trainer: L.Trainer) -> None:
        self._saved = self.ckpt_path(trainer)
        trainer.save_checkpoint(self._saved)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received, self._saved, self._after_validation = None, None, False
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.received is None or self._saved is not None or self._after_validation:
            return
        if _validation_follows(trainer):
            self._after_validation = True  # saved at its end (a checkpoint of this batch end skips it)
        else:
            self._save(trainer)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._after_validation and self._saved is None and trainer.state.fn == TrainerFn.FITTING:
            self._save(trainer)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._saved is not None:
            self._exit(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()
        if self._saved is not None:
            self._exit(trainer)  # the saved step was the last

    def _exit(self, trainer: L.Trainer) -> NoReturn:
        assert self.received is not None and self._saved is not None
        signum, path = self.received, self._saved
        self._saved, self._after_validation = None, False
        if trainer.is_global_zero:
            name = signal.Signals(signum).name
            resume = f"; resume with: {self.resume_command} --ckpt_path {path}" if self.resume_command else ""
            sys.stderr.write(f"{name}: stopped after step {trainer.global_step}, checkpoint {path}{resume}\n")
            sys.stderr.flush()
        raise SystemExit(128 + signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
