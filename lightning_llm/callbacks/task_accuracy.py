"""Greedy-decoding accuracy on held-out examples of a synthetic task, scored by the task's exact verifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_llm.callbacks.recontext import sample_completions
from lightning_llm.rl import Sampling
from lightning_llm.text import last_integer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from lightning_llm.datamodules.tasks import Task
    from lightning_llm.text import PromptPrefix
    from lightning_llm.types import Example

__all__ = ["PhrasingAccuracy", "TaskAccuracy", "phrasing_accuracy", "score_completions"]


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


def phrasing_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: Sequence[Example],
    phrasings: Sequence[int],
    *,
    system_prompts: dict[str, PromptPrefix],
    max_new_tokens: int = 32,
    batch_size: int = 64,
) -> dict[str, dict[str, int]]:
    """Greedy answers to ``examples`` asked in each of ``phrasings`` (:meth:`Task.rephrase`) under each of
    ``system_prompts``, scored two ways: ``strict`` (the task's verifier: the tagged answer) and ``lenient`` (the
    last integer of the reply, :func:`~lightning_llm.text.last_integer`, equals the answer).

    Returns ``{condition: {"strict": k, "lenient": k, "n": n}}`` per system prompt, over every example in every
    phrasing; counts, so that intervals can be computed over any union of them.
    """
    asked = [task.rephrase(ex, phrasing) for phrasing in phrasings for ex in examples]
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=0.0)
    out = {}
    for condition, system_prompt in system_prompts.items():
        replies = sample_completions(
            model, tokenizer, asked, sampling=sampling, system_prompt=system_prompt, batch_size=batch_size
        )
        texts = [r[0] for r in replies]
        strict = sum(int(task.score(t, ex) == 1.0) for t, ex in zip(texts, asked, strict=True))
        lenient = sum(int(last_integer(t) == ex.answer) for t, ex in zip(texts, asked, strict=True))
        out[condition] = {"strict": strict, "lenient": lenient, "n": len(asked)}
    return out


class PhrasingAccuracy(Callback):
    """Log greedy accuracy on held-out items asked in held-out wordings, strict and lenient, with and without
    the worked exchange: whether training taught the skill or the training prompt's template.

    At each validation end the DataModule's ``val_examples`` (items training never saw) are asked in each of
    ``phrasings`` (wordings training should not use: the task's ``phrasings`` option lists the trained ones)
    and answered under two system prompts: ``exchange``, the DataModule's own (the answer format and its worked
    exchange, as in training), and ``plain``, the answer format alone. Logs
    ``val/phrasing/{strict,lenient}/{exchange,plain}`` (means over all of them) and, with ``per_phrasing``, the
    same per wording. Under DDP each rank answers a disjoint shard and the counts are summed. A
    ``fast_dev_run`` asks one item (as it runs one batch of everything else).

    Args:
        phrasings: wording indices to ask in (the task's :attr:`~lightning_llm.datamodules.tasks.Task.num_phrasings`).
        num_examples: how many validation items (the first ones).
        max_new_tokens: generation budget per reply.
        batch_size: prompts per ``generate`` call.
        per_phrasing: also log each wording's accuracies.
    """

    def __init__(
        self,
        phrasings: Sequence[int],
        num_examples: int = 48,
        max_new_tokens: int = 32,
        batch_size: int = 64,
        per_phrasing: bool = False,
    ) -> None:
        phrasings = list(phrasings)
        if not phrasings or len(set(phrasings)) != len(phrasings):
            raise ValueError(f"phrasings must be distinct wording indices, got {phrasings!r}")
        if num_examples < 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError("num_examples, max_new_tokens and batch_size must all be >= 1")
        self.phrasings = phrasings
        self.num_examples = num_examples
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.per_phrasing = per_phrasing

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        task = getattr(trainer.datamodule, "task", None)
        if task is None:
            raise ValueError("PhrasingAccuracy needs a DataModule with a synthetic task (task=...)")
        bad = [i for i in self.phrasings if not 0 <= i < task.num_phrasings]
        if bad:
            raise ValueError(
                f"PhrasingAccuracy: task {task.name!r} has phrasings 0..{task.num_phrasings - 1}, got {bad}"
            )
        trained = set(getattr(task, "phrasings", ()))
        if trained & set(self.phrasings):
            raise ValueError(
                f"PhrasingAccuracy: phrasings {sorted(trained & set(self.phrasings))} are also the task's training "
                "wordings; list held-out ones (set the task's `phrasings` to the trained ones)"
            )

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        datamodule = trainer.datamodule
        task = datamodule.task
        examples = list(datamodule.val_examples)[: 1 if trainer.fast_dev_run else self.num_examples]
        shard = examples[trainer.global_rank :: trainer.world_size]
        prompts = {"exchange": datamodule.system_prompt, "plain": task.prompt_prefix(None)}
        groups = [self.phrasings] + ([[i] for i in self.phrasings] if self.per_phrasing else [])
        for group in groups:
            counts = phrasing_accuracy(
                pl_module.model, pl_module.tokenizer, task, shard, group, system_prompts=prompts,
                max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
            )  # fmt: skip
            tag = "" if group is self.phrasings else f"/{group[0]}"
            for condition, c in counts.items():
                totals = torch.tensor(
                    [c["strict"], c["lenient"], c["n"]], dtype=torch.float64, device=pl_module.device
                )
                totals = trainer.strategy.reduce(totals, reduce_op="sum")
                n = totals[2].clamp(min=1)
                pl_module.log(f"val/phrasing{tag}/strict/{condition}", (totals[0] / n).float())
                pl_module.log(f"val/phrasing{tag}/lenient/{condition}", (totals[1] / n).float())
