"""Behaviour: GRPO raises the task reward of a warmed-up tiny model (3 seeds, CPU, ~30 s each)."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback

from lightning_llm.callbacks import SFTWarmup
from lightning_llm.datamodules import PromptDataModule
from lightning_llm.modules.grpo import GRPOModule


class _Rewards(Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/reward"]))


def _mean(xs):
    return sum(xs) / len(xs)


def _gain(seed, tmp_path):
    """Sampled reward over the last 30 minus the first 30 of 150 GRPO steps after a 150-step SFT warm-up."""
    L.seed_everything(seed)
    rewards = _Rewards()
    trainer = L.Trainer(
        max_steps=150,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path / str(seed),
        callbacks=[SFTWarmup(steps=150, lr=3e-3, batch_size=32), rewards],
    )
    data = PromptDataModule(
        task="arithmetic", task_kwargs={"digits": 1, "ops": "+"}, num_train=80, num_val=16, batch_size=8
    )
    trainer.fit(GRPOModule(group_size=8, max_new_tokens=6, lr=5e-4), data)
    return _mean(rewards.values[-30:]) - _mean(rewards.values[:30])


@pytest.mark.slow
def test_grpo_raises_reward_of_warmed_up_model(tmp_path, tiny_backbone):
    """Paired over seeds 0-2: each seed's late reward against its own early reward (sampled, temperature 1, 64
    completions per step). Measured: gains +0.06 / +0.08 / +0.10 on the CI host of 2026-12-04, +0.112 / +0.120 /
    +0.148 on this session's host (2026-12-06; first host: about +0.23 on seed 0). The mean must exceed half the
    smaller of the two hosts' mean gains (0.04) and no seed may lose reward."""
    gains = [_gain(seed, tmp_path) for seed in (0, 1, 2)]
    print("reward gains per seed:", gains)
    assert sum(gains) / len(gains) > 0.04, gains
    assert min(gains) > 0.0, gains
