"""Exact resume as a user runs it: ``configs/sft_tiny.yaml`` through the CLI with validation in the loop, stopped by
a signal between two validations (the path Ctrl-C and a scheduler's SIGTERM take), resumed with ``--ckpt_path``."""

from __future__ import annotations

import csv
import glob
import os
import signal

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_llm.cli import main, run_cli

CONFIG = "configs/sft_tiny.yaml"


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the end of training step ``step``, as a user's Ctrl-C or a scheduler."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def _fit(root: str, *extra: str, callbacks: tuple[L.Callback, ...] = ()) -> None:
    # 640 examples: 10 steps an epoch, so the 30 steps cross two epoch boundaries; validation every 5 steps.
    args = [
        "fit", "--config", CONFIG, "--trainer.max_steps", "30", "--trainer.val_check_interval", "5",
        "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar",
        "false", "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", root,
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", root,
        "--data.init_args.num_train", "640", "--data.init_args.num_val", "16",
        "--trainer.callbacks.init_args.num_examples", "8", "--model.init_args.save_dir", f"{root}/model", *extra,
    ]  # fmt: skip
    run_cli(args, trainer_defaults={"callbacks": list(callbacks)})


def _losses(root: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for path in sorted(glob.glob(f"{root}/lightning_logs/*/metrics.csv")):
        with open(path) as handle:
            for row in csv.DictReader(handle):
                if row.get("train/loss"):
                    out[int(row["step"])] = float(row["train/loss"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_then_resume_equals_the_straight_run(signum, tmp_path, capsys, tiny_backbone):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    _fit(straight)
    with pytest.raises(SystemExit) as stopped:
        _fit(resumed, callbacks=(SignalAt(12, signum),))  # handled at the end of step 13, between validations
    assert stopped.value.code == 128 + signum
    assert not os.path.exists(f"{resumed}/model")  # the export of a finished run is not written
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(f"{signal.Signals(signum).name}: stopped after step 13, checkpoint ")
    checkpoint = glob.glob(f"{resumed}/**/interrupted.ckpt", recursive=True)
    assert len(checkpoint) == 1 and message.endswith(f"--ckpt_path {checkpoint[0]}")
    assert f"lightning-llm fit --config {CONFIG} " in message
    assert torch.load(checkpoint[0], weights_only=True)["global_step"] == 13
    _fit(resumed, "--ckpt_path", checkpoint[0])
    expected, got = _losses(straight), _losses(resumed)
    assert sorted(expected) == list(range(30))
    assert got == expected  # every step logged once, the same loss (across two epoch boundaries)
    weights_a = load_file(glob.glob(f"{straight}/model/*.safetensors")[0])
    weights_b = load_file(glob.glob(f"{resumed}/model/*.safetensors")[0])
    assert weights_a.keys() == weights_b.keys()
    for name, value in weights_a.items():
        assert torch.equal(value, weights_b[name]), name


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        (b"PK\x03\x04 truncated", "not a readable checkpoint (truncated or another format)"),
        ("tensor", "not a Lightning checkpoint"),
    ],
)
def test_a_bad_ckpt_path_is_one_error_line(content, expected, tmp_path, monkeypatch, capsys, tiny_backbone):
    path = tmp_path / "bad.ckpt"
    if content == "tensor":
        torch.save({"weight": torch.zeros(2)}, path)
    elif content is not None:
        path.write_bytes(content)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", CONFIG, "--trainer.default_root_dir", str(root), "--ckpt_path", str(path)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"error: --ckpt_path {path}: {expected}"), err
    assert len(err) == 2 and err[1].startswith("tip:")
    assert not root.exists()  # nothing written
