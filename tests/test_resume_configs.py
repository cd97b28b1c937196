"""Every training config, shrunk, through the real CLI: a run stopped by SIGINT/SIGTERM between two validations and
resumed with ``--ckpt_path`` logs the same values at every step and ends with the same weights as a straight run.

Shrunk: the tiny backbone, a few rollout/training batches with validation every 2, small data and warm-ups, the
config's own callbacks, module and DataModule otherwise as shipped. The signal is sent to this process at the end
of a training batch, as a user's Ctrl-C or a scheduler's SIGTERM would arrive; the CLI's InterruptCheckpoint saves
the step and exits, and the resume runs the command it prints.
"""

from __future__ import annotations

import csv
import glob
import inspect
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import yaml

from lightning_llm.cli import run_cli

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
BATCHES = 4  # training batches of a run; validation after batches 2 and 4
# The signal arrives at the end of batch 2 and is acted on at the end of batch 3: between two validations.
STOP_AFTER = 3
#: Callback arguments made small (applied where a callback has them).
CALLBACK_SIZES = {
    "steps": 2, "batch_size": 4, "num_examples": 4, "num_sentences": 8, "distill_steps": 2, "calibration": 1,
    "max_tokens": 256, "window": 4, "L": 8, "rank_every": 2, "stage_epochs": [1, 1], "max_new_tokens": 6, "samples": 1,
}  # fmt: skip
#: DataModule arguments made small (activation data: ``num_tokens`` tokens in batches of ``batch_size`` tokens).
DATA_SIZES = {"num_train": 12, "num_val": 4, "batch_size": 2}
ACTIVATION_SIZES = {"num_tokens": 256, "batch_size": 32, "buffer_size": 128, "harvest_batch_size": 4}
#: Module arguments made small.
MODEL_SIZES = {"init_sample_tokens": 256, "dead_window_tokens": 512}


def _updates_per_batch(model: dict[str, Any]) -> int:
    """Optimizer steps per training batch (``max_steps`` counts those): GRPO's ``ppo_epochs * mini_batches``."""
    from lightning_llm.modules import GRPOModule

    if not model["class_path"].endswith("GRPOModule"):
        return 1
    defaults = inspect.signature(GRPOModule.__init__).parameters
    args = model.get("init_args", {})
    get = lambda name: args.get(name, defaults[name].default)  # noqa: E731
    return int(get("ppo_epochs")) * int(get("mini_batches"))


def _shrunk(config: Path, root: Path) -> tuple[Path, dict[str, Any]]:
    cfg = yaml.safe_load(config.read_text())
    trainer, model, data = cfg["trainer"], cfg["model"], cfg["data"]
    updates = _updates_per_batch(model)
    trainer.update(
        max_steps=BATCHES * updates, max_epochs=None, val_check_interval=2, check_val_every_n_epoch=None,
        log_every_n_steps=1, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                                            "init_args": {"save_dir": str(root)}},
    )  # fmt: skip
    if trainer.get("limit_val_batches", 1) != 0:
        trainer["limit_val_batches"] = 1
    for callback in trainer.get("callbacks", []):
        args = callback.setdefault("init_args", {})
        for name, value in CALLBACK_SIZES.items():
            if name in args:
                args[name] = value
        if "save_dir" in args:
            args["save_dir"] = str(root / "callback_out")
    margs = model.setdefault("init_args", {})
    if margs.get("model") not in (None, "tiny", "tiny-moe"):
        margs["model"] = "tiny"  # a real checkpoint's steps are too slow here; the resume path is the same
    if "save_dir" in margs:
        margs["save_dir"] = str(root / "model")
    if "group_size" in margs:
        margs["group_size"] = 2
    if "max_new_tokens" in margs:
        margs["max_new_tokens"] = min(margs["max_new_tokens"], 6)
    for name, value in MODEL_SIZES.items():
        if name in margs:
            margs[name] = value
    dargs = data.setdefault("init_args", {})
    sizes = {**DATA_SIZES, **ACTIVATION_SIZES} if "num_tokens" in dargs else DATA_SIZES
    for name, value in sizes.items():
        if name in dargs:
            dargs[name] = value
    path = root.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path, cfg


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the end of training batch ``batch`` (1-based)."""

    def __init__(self, batch: int, signum: int) -> None:
        self.batch, self.signum, self.seen = batch, signum, 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.seen += 1
        if self.seen == self.batch:
            os.kill(os.getpid(), self.signum)


class FinalWeights(L.Callback):
    """Writes the module's ``state_dict`` at the end of a fit that finishes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.path)


def _fit(config: Path, *extra: str, callbacks: tuple[L.Callback, ...] = ()) -> None:
    run_cli(["fit", "--config", str(config), *extra], trainer_defaults={"callbacks": list(callbacks)})


#: Logged values that are not functions of the training (wall time) or that Lightning aggregates per epoch (an
#: interrupted epoch ends at another step).
_UNCOMPARABLE = ("time", "epoch", "_sec", "per_s", "throughput")


def _logged(root: Path) -> dict[tuple[int, str], float]:
    """``(step, name) -> value`` over the run's CSV logs, in order (an interrupted run's, then its resume's).

    A value equal to the one its name had at its previous logged step is dropped: within an epoch Lightning
    re-emits at every step the last value of a step-level metric that the step did not log (its result
    collection is reset at epoch ends and is not in the checkpoint), so a straight run repeats values that its
    resume, with a fresh collection, does not. Applied alike to both runs.
    """
    out: dict[tuple[int, str], float] = {}
    last: dict[str, float] = {}
    for path in sorted(glob.glob(f"{root}/lightning_logs/*/metrics.csv")):
        with open(path) as handle:
            for row in csv.DictReader(handle):
                for key, text in row.items():
                    if key == "step" or not text or any(word in key for word in _UNCOMPARABLE):
                        continue
                    value = float(text)
                    if last.get(key) != value:
                        out[int(row["step"]), key] = value
                    last[key] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_interrupted_and_resumed_equals_the_straight_run(config, tmp_path, capsys, tiny_backbone):
    signum = (signal.SIGINT, signal.SIGTERM)[CONFIGS.index(config) % 2]  # both paths, over the configs
    _check(config, tmp_path, capsys, signum, STOP_AFTER)


def test_a_signal_before_a_validation_saves_after_it(tmp_path, capsys, tiny_backbone):
    """Acted on at a batch after which a validation is due: the checkpoint is written at that validation's end,
    so it holds what the validation changed (here EarlyStopping's best score; one written at the batch end would
    resume without it), and the resume is exact."""
    checkpoint = _check(
        CONFIGS[[c.stem for c in CONFIGS].index("needle_tiny")], tmp_path, capsys, signal.SIGTERM, 2
    )
    (stopping,) = [
        v for k, v in torch.load(checkpoint, weights_only=True)["callbacks"].items() if "EarlyStop" in k
    ]
    assert torch.isfinite(torch.as_tensor(stopping["best_score"])), stopping


def _check(config: Path, tmp_path: Path, capsys: Any, signum: int, stop_after: int) -> str:
    """Straight vs interrupted after ``stop_after`` batches and resumed; returns the interrupt's checkpoint."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight_yaml, cfg = _shrunk(config, straight)
    resumed_yaml, _ = _shrunk(config, resumed)
    _fit(straight_yaml, callbacks=(FinalWeights(tmp_path / "straight.pt"),))
    with pytest.raises(SystemExit) as stopped:
        _fit(resumed_yaml, callbacks=(SignalAt(stop_after - 1, signum), FinalWeights(tmp_path / "lost.pt")))
    assert stopped.value.code == 128 + signum
    assert not (tmp_path / "lost.pt").exists()  # the interrupted fit did not finish
    line = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = line.rsplit("--ckpt_path ", 1)[1]
    updates = _updates_per_batch(cfg["model"])
    assert torch.load(checkpoint, weights_only=True)["global_step"] == stop_after * updates, line
    _fit(resumed_yaml, "--ckpt_path", checkpoint, callbacks=(FinalWeights(tmp_path / "resumed.pt"),))
    expected, got = _logged(straight), _logged(resumed)
    steps = {step for step, _ in expected}
    assert len(steps) >= BATCHES - 1 and any(key.startswith("val/") for _, key in expected) == (
        cfg["trainer"].get("limit_val_batches") != 0
    )
    assert got.keys() == expected.keys(), sorted(set(got.keys()) ^ set(expected.keys()))
    differing = {key: (expected[key], got[key]) for key in expected if expected[key] != got[key]}
    assert not differing, differing
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys()
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
    return checkpoint
