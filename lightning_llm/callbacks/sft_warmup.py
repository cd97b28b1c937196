"""A short supervised warm-up before RL, on the reference completions of the DataModule's own task.

RL from a random or format-ignorant policy gets zero reward everywhere and so zero advantage: nothing to learn
from. The usual recipe (DeepSeek-R1's cold start, Search-R1's and most GRPO papers' SFT stage) is a short SFT
phase first. As a callback, that phase composes with any RL module and any CLI config, instead of needing a
separate run and a checkpoint hand-off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llm.lm import labels_to_mask, target_logprobs

__all__ = ["SFTWarmup"]


def _cycle(data: Any) -> Iterator[dict[str, Any]]:
    """Batches of ``data.train_dataloader()``, epoch after epoch (a new shuffle each epoch)."""
    while True:
        yield from data.train_dataloader()


class SFTWarmup(Callback):
    """Fine-tune ``pl_module.model`` on the task's reference completions for ``steps`` steps at fit start.

    Uses the same examples as the RL DataModule's training split (same task, parameters, seed and split, so
    validation prompts stay unseen), rendered and masked by :class:`ChatSFTDataModule`. Its own AdamW (not the
    RL optimiser, whose state stays untouched). Under DDP each rank trains on its shard and gradients are
    averaged by hand (the warm-up runs outside the DDP wrapper). Runs once: the state records completion, so
    a resumed run does not warm up again on top of an RL checkpoint. Under ``Trainer(fast_dev_run=n)`` it runs
    at most ``n`` steps (``True``: 1), like every other loop of a fast dev run.

    With ``extra_tasks`` each step also trains on one batch of every extra synthetic task (``name →
    task_kwargs``), and the loss is the sum of the per-task token means: a skill the RL phase assumes but the
    DataModule's task does not teach. E.g. LARFT's hindsight counting prompt (task ``word_count``), which an
    instruct model roughly follows and a tiny model trained from scratch has never seen. Extra tasks use the
    DataModule's tokenizer, length budget and seed, no system prompt, and ``extra_num_train`` examples each.

    Args:
        steps: optimisation steps of warm-up.
        lr: AdamW learning rate of the warm-up.
        batch_size: examples per warm-up step (per task).
        extra_tasks: other synthetic tasks to train on at each step, ``{name: task_kwargs}``.
        extra_num_train: examples of each extra task.
    """

    def __init__(
        self,
        steps: int = 300,
        lr: float = 3e-3,
        batch_size: int = 32,
        extra_tasks: dict[str, dict[str, Any]] | None = None,
        extra_num_train: int = 4096,
    ) -> None:
        if steps < 0 or lr <= 0 or batch_size < 1 or extra_num_train < 1:
            raise ValueError("need steps >= 0, lr > 0, batch_size >= 1 and extra_num_train >= 1")
        from lightning_llm.datamodules.tasks import get_task

        for name, kwargs in (extra_tasks or {}).items():
            get_task(name, **(kwargs or {}))  # unknown names and bad parameters fail here, not at fit start
        self.extra_tasks = {name: dict(kwargs or {}) for name, kwargs in (extra_tasks or {}).items()}
        self.extra_num_train = extra_num_train
        self.steps = steps
        self.lr = lr
        self.batch_size = batch_size
        self.done = False
        self.final_loss: float | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done or self.steps == 0:
            return
        from lightning_llm.datamodules import ChatSFTDataModule

        source = trainer.datamodule
        if getattr(source, "task", None) is None:
            raise ValueError("SFTWarmup needs a DataModule built from a synthetic task (data.task)")
        keys = (
            "task",
            "task_kwargs",
            "tokenizer",
            "system_prompt",
            "num_train",
            "num_val",
            "seed",
            "max_length",
        )
        data = ChatSFTDataModule(**{k: source.hparams[k] for k in keys}, batch_size=self.batch_size)
        sources = [data]
        for name, kwargs in self.extra_tasks.items():
            shared = {k: source.hparams[k] for k in ("tokenizer", "num_val", "seed", "max_length")}
            sources.append(
                ChatSFTDataModule(
                    task=name,
                    task_kwargs=kwargs,
                    num_train=self.extra_num_train,
                    batch_size=self.batch_size,
                    **shared,
                )
            )
        for each in sources:
            each.setup("fit")
        steps = min(self.steps, int(trainer.fast_dev_run)) if trainer.fast_dev_run else self.steps
        model = pl_module.model
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        model.train()
        step, loss = 0, torch.zeros(())
        streams = [_cycle(each) for each in sources]
        while step < steps:
            loss = torch.zeros((), device=pl_module.device)
            for stream in streams:
                batch = {k: v.to(pl_module.device) for k, v in next(stream).items()}
                mask = labels_to_mask(batch["input_ids"], batch["labels"])
                logprobs, _ = target_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)
                loss = loss - logprobs.mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if trainer.world_size > 1:
                for p in params:
                    if p.grad is not None:
                        p.grad = trainer.strategy.reduce(p.grad, reduce_op="mean")
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
        self.done = True
        self.final_loss = float(loss.detach())
        rank_zero_info(f"SFTWarmup: {steps} steps, final loss {self.final_loss:.4f}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "final_loss": self.final_loss}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.final_loss = state_dict.get("final_loss")
