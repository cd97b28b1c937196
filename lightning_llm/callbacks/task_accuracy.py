"""Greedy-decoding accuracy on held-out examples of a synthetic task, scored by the task's exact verifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from lightning_llm.datamodules.tasks import Task
    from lightning_llm.text import PromptPrefix
    from lightning_llm.types import Example

__all__ = ["TaskAccuracy", "score_completions"]


def score_completions(
    module: Any,
    task: Task,
    examples: Sequence[Example],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    system_prompt: PromptPrefix = None,
) -> list[float]:
    """Generate one greedy completion per example with ``module.generate`` and score it with ``task.score``."""
    scores: list[float] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        completions = module.generate(
            [ex.prompt for ex in chunk], max_new_tokens=max_new_tokens, system_prompt=system_prompt
        )
        scores.extend(task.score(c, ex) for c, ex in zip(completions, chunk, strict=True))
    return scores


class TaskAccuracy(Callback):
    """Log ``val/accuracy``: mean verifier score of greedy completions on the DataModule's validation examples.

    Needs a DataModule with a synthetic ``task`` (``None`` for real sources: the callback then does nothing)
    and ``val_examples``, and a module with ``generate``. Under DDP each rank scores a disjoint shard and the
    counts are summed, so the number is over exactly ``num_examples`` examples whatever the world size.

    Args:
        num_examples: how many validation examples to score (the first ones, for comparability across epochs).
        max_new_tokens: generation budget per completion.
        batch_size: prompts per ``generate`` call.
    """

    def __init__(self, num_examples: int = 64, max_new_tokens: int = 32, batch_size: int = 64) -> None:
        if num_examples < 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError("num_examples, max_new_tokens and batch_size must all be >= 1")
        self.num_examples = num_examples
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        datamodule = trainer.datamodule
        task = getattr(datamodule, "task", None)
        if task is None:
            return
        examples = list(datamodule.val_examples)[: self.num_examples]
        shard = examples[trainer.global_rank :: trainer.world_size]
        scores = score_completions(
            pl_module,
            task,
            shard,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            system_prompt=getattr(datamodule, "system_prompt", None),
        )
        totals = torch.tensor([sum(scores), len(scores)], dtype=torch.float64, device=pl_module.device)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        pl_module.log("val/accuracy", (totals[0] / totals[1].clamp(min=1)).float(), prog_bar=True)
