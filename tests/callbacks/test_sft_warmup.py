"""SFTWarmup: the warm-up on the DataModule's task, and on extra tasks beside it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_llm.callbacks import SFTWarmup
from lightning_llm.datamodules import ChatSFTDataModule, PromptDataModule
from lightning_llm.lm import labels_to_mask, target_logprobs
from lightning_llm.modules.grpo import GRPOModule


def _nll(model, task: str, task_kwargs: dict) -> float:
    data = ChatSFTDataModule(
        task=task, task_kwargs=task_kwargs, num_train=16, num_val=32, batch_size=32, seed=5
    )
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    mask = labels_to_mask(batch["input_ids"], batch["labels"])
    with torch.no_grad():
        return float(-target_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)[0].mean())


def _warm(quiet_trainer, extra_tasks=None) -> tuple[GRPOModule, SFTWarmup]:
    L.seed_everything(0)
    module = GRPOModule(rewards=["length"], group_size=2, max_new_tokens=8)
    warmup = SFTWarmup(steps=30, lr=3e-3, batch_size=16, extra_tasks=extra_tasks, extra_num_train=256)
    data = PromptDataModule(
        task="length", task_kwargs={"min_words": 1, "max_words": 4}, num_train=256, num_val=8
    )
    quiet_trainer(1, [warmup]).fit(module, data)  # the warm-up runs at the first training step
    return module, warmup


@pytest.mark.slow
def test_extra_task_is_trained_beside_the_datamodules_task(quiet_trainer, tiny_backbone):
    counting = {"min_words": 1, "max_words": 8}
    plain, plain_warmup = _warm(quiet_trainer)
    mixed, mixed_warmup = _warm(quiet_trainer, {"word_count": counting})
    assert plain_warmup.done and mixed_warmup.done
    # the extra task is learnt (nats per label token on held-out counting examples)...
    assert _nll(mixed.model, "word_count", counting) < _nll(plain.model, "word_count", counting) - 1.0
    # ...and the main task still is (against the untrained model)
    length = {"min_words": 1, "max_words": 4}
    L.seed_everything(0)
    untrained = GRPOModule(rewards=["length"], group_size=2, max_new_tokens=8).model
    assert _nll(mixed.model, "length", length) < _nll(untrained, "length", length) - 1.0
    assert mixed_warmup.state_dict()["done"] is True


def test_extra_tasks_are_checked_at_construction():
    with pytest.raises(ValueError, match="unknown task"):
        SFTWarmup(extra_tasks={"no_such_task": {}})
    with pytest.raises(ValueError, match="min_words"):
        SFTWarmup(extra_tasks={"word_count": {"min_words": 5, "max_words": 1}})
    with pytest.raises(ValueError, match="extra_num_train"):
        SFTWarmup(extra_num_train=0)
