"""The CLI's step progress bar and its quieting of third-party noise."""

from __future__ import annotations

import warnings

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_llm.cli import LightningLLMCLI, quiet_known_noise
from lightning_llm.trainer import StepProgressBar


def _fit(bar, max_steps, tmp_path, ckpt_path=None):
    trainer = L.Trainer(
        max_steps=max_steps,
        limit_train_batches=4,  # four batches an epoch: a step-bounded run spans epochs
        limit_val_batches=0,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[bar],
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def test_one_bar_counts_steps_of_max_steps_across_epochs_and_resumes(tmp_path):
    bar = StepProgressBar()
    trainer = _fit(bar, 10, tmp_path)
    assert trainer.current_epoch >= 2  # the run crossed epochs
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (10, 10)
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)
    ckpt = next(tmp_path.rglob("*.ckpt"))
    resumed = StepProgressBar()
    _fit(resumed, 14, tmp_path / "resumed", ckpt_path=ckpt)
    assert (resumed.train_progress_bar.n, resumed.train_progress_bar.total) == (14, 14)


def test_epoch_bounded_runs_keep_lightnings_bar(tmp_path):
    bar = StepProgressBar()
    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=3, limit_val_batches=0, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[bar],
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)


def test_cli_adds_the_bar_unless_disabled_or_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def bars(*flags):
        cli = LightningLLMCLI(
            BoringModel, L.LightningDataModule, run=False, args=["--trainer.accelerator=cpu", *flags]
        )
        return [type(cb).__name__ for cb in cli.trainer.callbacks if "ProgressBar" in type(cb).__name__]

    assert bars() == ["StepProgressBar"]
    assert bars("--trainer.enable_progress_bar=false") == []
    assert bars("--trainer.callbacks+=TQDMProgressBar") == ["TQDMProgressBar"]


def test_known_noise_is_quiet_and_other_warnings_are_not():
    quiet_known_noise()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_known_noise()  # filters go first, after simplefilter
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
        warnings.warn("a real problem", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real problem"]
