"""Behaviour: with a high learning rate and several updates per rollout batch, vanilla GRPO lets the likelihood of
correct responses collapse; LLDS (arXiv 2512.04220, coef 0.2, action gate) keeps it (seeded, CPU, ~25 s idle).

Both arms start from the same SFT warm-up of the tiny model on 1-digit addition and see the same first rollout
batch. "Likelihood of correct responses" is measured on a fixed set of them: the task's reference completions of
the training prompts (mean per-token log-likelihood), after every rollout batch. The module's own
``train/LLDS/loglik_pos`` measures the same thing on the policy's *sampled* correct responses, and is undefined
exactly when it matters: a collapsed vanilla policy samples no correct response at all.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_llm.callbacks import LLDSRegularizer
from lightning_llm.callbacks.sft_warmup import SFTWarmup
from lightning_llm.datamodules import ChatSFTDataModule, PromptDataModule
from lightning_llm.lm import labels_to_mask, target_logprobs
from lightning_llm.modules.grpo import GRPOModule

TASK = {"task": "arithmetic", "task_kwargs": {"digits": 1, "ops": "+"}, "num_train": 80, "num_val": 16}
ROLLOUT_BATCHES = 6
PPO_EPOCHS, MINI_BATCHES = 2, 4  # 8 updates per rollout batch of 8 prompts x 8 completions
LR = 2e-3  # 4x the lr at which plain GRPO (one update per batch) improves this model
SFT_SEED, RL_SEEDS = 0, (1, 2, 3)


def _mean(values):
    return sum(values) / len(values)


def _median(values):
    return sorted(values)[len(values) // 2]


class _CorrectLikelihood(Callback):
    """Mean per-token log π_θ of the reference completions of the training prompts, after each rollout batch."""

    def __init__(self) -> None:
        data = ChatSFTDataModule(**TASK, batch_size=TASK["num_train"], max_length=64)
        data.setup("fit")
        self.batch = next(iter(data.train_dataloader()))
        self.values: list[float] = []
        self.rewards: list[float] = []

    @torch.no_grad()
    def measure(self, model) -> float:
        b = self.batch
        mask = labels_to_mask(b["input_ids"], b["labels"])
        return float(target_logprobs(model, b["input_ids"], b["attention_mask"], mask)[0].mean())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(self.measure(pl_module.model))
        self.rewards.append(float(trainer.callback_metrics["train/reward"]))


def _grpo_arm(quiet_trainer, warm_state, coef, seed):
    L.seed_everything(seed)  # same seed in both arms: the first rollout batch is identical
    module = GRPOModule(
        group_size=8, max_new_tokens=6, lr=LR, ppo_epochs=PPO_EPOCHS, mini_batches=MINI_BATCHES
    )
    module.model.load_state_dict(warm_state)
    probe = _CorrectLikelihood()
    llds = LLDSRegularizer(coef=coef, gate="action")  # coef=0: measures (fire rate) but adds nothing
    fire = []

    class _Fire(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            fire.append(float(trainer.callback_metrics["train/LLDS/fire_rate"]))

    trainer = quiet_trainer(ROLLOUT_BATCHES * PPO_EPOCHS * MINI_BATCHES, [llds, probe, _Fire()])
    trainer.fit(module, PromptDataModule(**TASK, batch_size=8))
    return probe, fire


@pytest.mark.slow
def test_llds_keeps_likelihood_of_correct_responses(quiet_trainer, tiny_backbone):
    # SFT warm-up once (a fit with no RL step), shared by both arms.
    L.seed_everything(SFT_SEED)
    warm = GRPOModule(group_size=8, max_new_tokens=6)
    quiet_trainer(0, [SFTWarmup(steps=150, lr=3e-3, batch_size=32)]).fit(
        warm, PromptDataModule(**TASK, batch_size=8)
    )
    warm_state = copy.deepcopy(warm.model.state_dict())
    start = _CorrectLikelihood().measure(warm.model)

    reports, falls, ratios, gaps, fires = [], [], [], [], []
    for seed in RL_SEEDS:
        vanilla, _ = _grpo_arm(quiet_trainer, warm_state, coef=0.0, seed=seed)
        llds, fire = _grpo_arm(quiet_trainer, warm_state, coef=0.2, seed=seed)
        reports.append(
            f"seed {seed}: vanilla {[round(v, 2) for v in vanilla.values]}; LLDS {[round(v, 2) for v in llds.values]}; "
            f"rewards vanilla {vanilla.rewards}, LLDS {llds.rewards}"
        )
        # Means over the last 3 rollout batches, nats per token.
        vanilla_end, llds_end = _mean(vanilla.values[-3:]), _mean(llds.values[-3:])
        falls.append(start - vanilla_end)
        ratios.append((start - llds_end) / max(start - vanilla_end, 1e-6))
        gaps.append(llds_end - vanilla_end)
        fires.append(_mean(fire))
    report = f"start {start:.2f}; " + " | ".join(reports)
    # Medians over RL seeds 1-3, each arm from the same warm-up and the same first rollout batch. Measured on the
    # development host with RL seeds 1-8: vanilla fell by 2.8-5.3 nats, LLDS by 0.4-0.9, i.e. 0.10-0.22 of
    # vanilla's fall; LLDS - vanilla: 2.3-4.7; fire rate 0.31-0.43. The trajectory is chaotic in float rounding:
    # on another CPU one seed's LLDS arm collapsed too (fall ratio 0.76, gap 0.6), hence medians over 3 seeds.
    # Not asserted: reward, which is noisy at this size.
    assert _median(falls) > 1.5, report  # vanilla: the likelihood of correct responses collapses
    assert _median(ratios) < 0.5, report  # LLDS: it falls by less than half as much
    assert _median(gaps) > 1.0, report
    assert _median(fires) > 0.1, fires  # the regulariser did act
