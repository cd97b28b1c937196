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
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_llm.lm import labels_to_mask, target_logprobs
from lightning_llm.rl import RLCallback

__all__ = ["SFTWarmup"]


def _cycle(data: Any) -> Iterator[dict[str, Any]]:
    """Batches of ``data.train_dataloader()``, epoch after epoch (a new shuffle each epoch)."""
    while True:
        yield from data.train_dataloader()


class SFTWarmup(RLCallback):
    """Fine-tune the policy on the task's reference completions for ``steps`` steps before RL starts.

    Uses the same examples as the RL DataModule's training split (same task, parameters, seed, split and system
    prompt, so validation prompts stay unseen), rendered and masked by :class:`ChatSFTDataModule` with the
    DataModule's tokenizer. ``GRPOModule`` runs the steps at its first training step, through the strategy:
    the loss goes through ``manual_backward`` (gradients averaged by DDP, sharded by FSDP) and this warm-up's
    AdamW is one of the module's optimizers (the RL optimiser's state stays untouched); the warm-up steps do not
    count towards ``max_steps``. Runs once: the state records the steps done, so a resumed run does not warm up
    again on top of an RL checkpoint. Under ``Trainer(fast_dev_run=n)`` it runs at most ``n`` steps (``True``:
    1), like every other loop of a fast dev run. The reference policy of a KL penalty is the policy after the
    warm-up (see ``GRPOModule``).

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
        max_grad_norm: gradient clipping norm of the warm-up steps.
    """

    is_warmup = True

    def __init__(
        self,
        steps: int = 300,
        lr: float = 3e-3,
        batch_size: int = 32,
        extra_tasks: dict[str, dict[str, Any]] | None = None,
        extra_num_train: int = 4096,
        max_grad_norm: float = 1.0,
    ) -> None:
        if steps < 0 or lr <= 0 or batch_size < 1 or extra_num_train < 1 or max_grad_norm <= 0:
            raise ValueError(
                "need steps >= 0, lr > 0, batch_size >= 1, extra_num_train >= 1 and max_grad_norm > 0"
            )
        from lightning_llm.datamodules.tasks import get_task

        for name, kwargs in (extra_tasks or {}).items():
            get_task(name, **(kwargs or {}))  # unknown names and bad parameters fail here, not at fit start
        self.extra_tasks = {name: dict(kwargs or {}) for name, kwargs in (extra_tasks or {}).items()}
        self.extra_num_train = extra_num_train
        self.steps = steps
        self.lr = lr
        self.batch_size = batch_size
        self.max_grad_norm = max_grad_norm
        self.steps_done = 0
        self.done = False
        self.final_loss: float | None = None
        self._streams: list[Iterator[dict[str, Any]]] | None = None

    @override
    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.steps and getattr(trainer.datamodule, "task", None) is None:
            raise ValueError("SFTWarmup needs a DataModule built from a synthetic task (data.task)")

    def remaining(self, trainer: L.Trainer) -> int:
        """Warm-up steps still to run (0 once done, or for a resumed run that had finished its warm-up)."""
        if self.done:
            return 0
        steps = min(self.steps, int(trainer.fast_dev_run)) if trainer.fast_dev_run else self.steps
        left = steps - self.steps_done
        if left <= 0:
            self.done = True
            if self.steps_done:
                rank_zero_info(f"SFTWarmup: {self.steps_done} steps, final loss {self.final_loss:.4f}")
        return max(0, left)

    def warmup_loss(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Tensor:
        """The loss of the next warm-up step: the sum over tasks of the token-mean NLL of one batch each."""
        if self._streams is None:
            self._streams = [_cycle(data) for data in self._sources(trainer)]
        loss = torch.zeros((), device=pl_module.device)
        for stream in self._streams:
            batch = {k: v.to(pl_module.device) for k, v in next(stream).items()}
            mask = labels_to_mask(batch["input_ids"], batch["labels"])
            logprobs, _ = target_logprobs(pl_module.model, batch["input_ids"], batch["attention_mask"], mask)
            loss = loss - logprobs.mean()
        return loss

    def step_done(self, loss: Tensor) -> None:
        self.steps_done += 1
        self.final_loss = float(loss)

    def _sources(self, trainer: L.Trainer) -> list[Any]:
        from lightning_llm.datamodules import ChatSFTDataModule

        source = trainer.datamodule
        keys = ("task", "task_kwargs", "system_prompt", "num_train", "num_val", "seed", "max_length")
        tokenizer = source.tokenizer
        data = ChatSFTDataModule(**{k: source.hparams[k] for k in keys}, batch_size=self.batch_size)
        sources = [data]
        for name, kwargs in self.extra_tasks.items():
            shared = {k: source.hparams[k] for k in ("num_val", "seed", "max_length")}
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
            each.use_tokenizer(tokenizer)
            each.setup("fit")
        return sources

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "steps_done": self.steps_done, "final_loss": self.final_loss}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict["done"])
        self.steps_done = int(state_dict.get("steps_done", self.steps if self.done else 0))
        self.final_loss = state_dict.get("final_loss")
