"""A short supervised warm-up before RL, on the reference completions of the DataModule's own task.

RL from a random or format-ignorant policy gets zero reward everywhere and so zero advantage: nothing to learn
from. The usual recipe (DeepSeek-R1's cold start, Search-R1's and most GRPO papers' SFT stage) is a short SFT
phase first. As a callback, that phase composes with any RL module and any CLI config, instead of needing a
separate run and a checkpoint hand-off.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llm.modules._lm import labels_to_mask, target_logprobs

__all__ = ["SFTWarmup"]


class SFTWarmup(Callback):
    """Fine-tune ``pl_module.model`` on the task's reference completions for ``steps`` steps at fit start.

    Uses the same examples as the RL DataModule's training split (same task, parameters, seed and split, so
    validation prompts stay unseen), rendered and masked by :class:`ChatSFTDataModule`. Its own AdamW (not the
    RL optimiser, whose state stays untouched). Under DDP each rank trains on its shard and gradients are
    averaged by hand (the warm-up runs outside the DDP wrapper). Runs once: the state records completion, so
    a resumed run does not warm up again on top of an RL checkpoint. Under ``Trainer(fast_dev_run=n)`` it runs
    at most ``n`` steps (``True``: 1), like every other loop of a fast dev run.

    Args:
        steps: optimisation steps of warm-up.
        lr: AdamW learning rate of the warm-up.
        batch_size: examples per warm-up step.
    """

    def __init__(self, steps: int = 300, lr: float = 3e-3, batch_size: int = 32) -> None:
        if steps < 0 or lr <= 0 or batch_size < 1:
            raise ValueError("need steps >= 0, lr > 0 and batch_size >= 1")
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
        data.setup("fit")
        steps = min(self.steps, int(trainer.fast_dev_run)) if trainer.fast_dev_run else self.steps
        model = pl_module.model
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        model.train()
        step, loss = 0, torch.zeros(())
        while step < steps:
            for batch in data.train_dataloader():
                if step >= steps:
                    break
                batch = {k: v.to(pl_module.device) for k, v in batch.items()}
                mask = labels_to_mask(batch["input_ids"], batch["labels"])
                logprobs, _ = target_logprobs(model, batch["input_ids"], batch["attention_mask"], mask)
                loss = -logprobs.mean()
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
        self.final_loss = float(loss)
        rank_zero_info(f"SFTWarmup: {steps} steps, final loss {self.final_loss:.4f}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "final_loss": self.final_loss}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.final_loss = state_dict.get("final_loss")
