"""Behaviour: RaGEP — at 50% experts, a trained tiny MoE loses less held-out loss than with frequency pruning.

The library's ``"tiny-moe"`` backbone (a random Mixtral: 4 layers × 8 SwiGLU experts, top-2, hidden 64) is
fine-tuned with ``CausalLMModule`` (lr 3e-3) for 200 steps of 16 chat conversations from a round-robin mixture
of three synthetic tasks (``arithmetic``, ``word_count``, ``copy``; max 128 tokens). Two copies are pruned to
50% of the routed experts (16 of 32) by ``ExpertPruning.prune`` from the *same* 8 calibration batches (the first
8 training batches): ``"ragep"`` (effective-rank layer budgets, greedy spectral salience) and ``"frequency"``
(router top-k counts, 4 experts per layer). All are scored by mean cross-entropy per response token on the 150
held-out conversations of the mixture.

Measured on the development machine (2 CPU cores shared with other jobs, one thread, fp32), held-out loss
unpruned / RaGEP / frequency:

- seed 0: 0.743 / 1.221 / 1.743 (RaGEP better by 0.522)
- seed 1: 0.732 / 1.198 / 2.524 (by 1.326)
- seed 2: 0.760 / 1.075 / 1.520 (by 0.445)

(about 60-100 s per seed on the loaded machine). The issue's claim is that RaGEP's loss at 50% experts is no
worse than the frequency baseline's; the test asserts, at seed 0, RaGEP <= frequency - 0.2 (under half the
smallest gap seen), finite losses, and the unpruned model below both pruned ones. The scratch study behind the
issue (400 steps, 4 methods) saw the same ordering: frequency 2.254 / 1.950 vs RaGEP 1.203 / 0.965 (seeds 0, 1).

Ablation (same runs, seeds 0 / 1; every method with ``budget="uniform"`` (4 per layer) and ``"erank"``):
RaGEP 1.440 / 1.091 uniform, 1.221 / 1.198 erank; frequency 1.743 / 2.524 and 1.403 / 1.724; REAP 1.701 / 0.912
and 1.674 / 0.902; NAEE 1.384 / 1.306 and 1.078 / 1.198. The effective-rank budgets help every method but REAP
at seed 1; with them, RaGEP's spectral selection beats frequency on both seeds but not REAP or NAEE (NAEE-erank
1.078 < RaGEP 1.221 at seed 0; REAP 0.90 < 1.20 at seed 1). The test asserts the issue's claim (vs frequency)
only.
"""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from lightning_llm.backbones import load_backbone
from lightning_llm.callbacks import ExpertPruning
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.datamodules.tasks import Example, Task, get_task, register_task
from lightning_llm.metrics import token_nll
from lightning_llm.modules import CausalLMModule

pytestmark = pytest.mark.slow

TASKS = ("arithmetic", "word_count", "copy")
STEPS, BATCH, LR, CALIBRATION = 200, 16, 3e-3, 8
MARGIN = 0.2  # the smallest gap measured over seeds 0-2 was 0.445 (module docstring)


@register_task
class _RagepMixture(Task):
    """Round-robin mixture of :data:`TASKS` (each task's own examples, interleaved)."""

    name = "_ragep_behaviour_mixture"

    def __init__(self, tasks: tuple[str, ...] = TASKS) -> None:
        self.tasks = [get_task(t) for t in tasks]

    def generate(self, n: int, seed: int) -> list[Example]:
        k = len(self.tasks)
        parts = [t.generate(n // k + (i < n % k), seed) for i, t in enumerate(self.tasks)]
        return [ex for group in zip(*parts, strict=False) for ex in group] + [
            ex for p in parts for ex in p[len(parts[-1]) :]
        ]

    def score(self, completion: str, example: Example) -> float:
        return max(t.score(completion, example) for t in self.tasks)


def heldout_loss(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy per supervised (response) token."""
    total, count = token_nll(model, batches)
    return total / count


def run(seed: int, trainer_factory, steps: int = STEPS) -> dict[str, float]:
    """Train ``tiny-moe`` on the mixture, prune copies to 50% with RaGEP and frequency; held-out losses."""
    torch.manual_seed(seed)
    L.seed_everything(seed, verbose=False)
    data = ChatSFTDataModule(
        task=_RagepMixture.name, tokenizer="tiny-moe", num_train=steps * BATCH, num_val=150,
        batch_size=BATCH, max_length=128, seed=7 + seed,
    )  # fmt: skip
    lm = CausalLMModule("tiny-moe", lr=LR)
    trainer_factory(max_steps=steps).fit(lm, data)
    model = lm.model
    calibration = []
    for batch in data.train_dataloader():
        calibration.append(batch)
        if len(calibration) == CALIBRATION:
            break
    held_out = list(data.val_dataloader())
    losses = {"unpruned": heldout_loss(model, held_out)}
    for method in ("ragep", "frequency"):
        pruned = copy.deepcopy(model)
        ExpertPruning(method, keep_ratio=0.5).prune(pruned, calibration)
        losses[method] = heldout_loss(pruned, held_out)
    return losses


@pytest.fixture(scope="module")
def losses(quiet_trainer, tiny_backbone):
    load_backbone("tiny-moe")  # build the cache outside the timed part
    return run(0, quiet_trainer)


def test_ragep_no_worse_than_frequency_at_half_the_experts(losses):
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses["ragep"] <= losses["frequency"] - MARGIN, losses


def test_unpruned_beats_both(losses):
    assert losses["unpruned"] < min(losses["ragep"], losses["frequency"]), losses
