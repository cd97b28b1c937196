"""The accuracy-vs-budget study of docs/methods.md §11: a retrieval backbone and its accuracy under each policy.

* :func:`train_retrieval_backbone` fine-tunes a backbone (``"tiny"`` by default, randomly initialised) on a
  long-context task of :class:`~lightning_llm.datamodules.NeedleDataModule` until it answers from the full cache,
  and saves it (``load_backbone(directory)`` reloads it).
* :func:`accuracy_under_budget` generates greedily through
  :func:`~lightning_llm.eviction.generate_with_budget` for every example and scores the answers with the task's
  verifier; the budget is an absolute token count or a fraction of each prompt.

On a CPU in minutes the tiny backbone learns the single needle with a one-digit value (``needle``,
``value_digits=1``, 40 filler words): full-cache accuracy jumps from chance to 100% after a seed-dependent number of
steps (250 of batch 32 at lr 3e-3 at seed 0, one thread). It does not learn the content-matched tasks
(``multikey_needle``, ``associative_recall``) at this size; docs/methods.md §11 records the measurements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.datamodules.tasks import Task
from lightning_llm.eviction.base import EvictionPolicy, FullCache
from lightning_llm.eviction.generate import generate_with_budget
from lightning_llm.trainer import quiet_trainer
from lightning_llm.types import Example

__all__ = ["BudgetResult", "accuracy_under_budget", "train_retrieval_backbone"]


def train_retrieval_backbone(
    directory: str | Path,
    *,
    model: str = "tiny",
    task: str = "needle",
    task_kwargs: dict[str, Any] | None = None,
    max_steps: int = 1500,
    target_accuracy: float = 0.98,
    check_every: int = 50,
    num_check: int = 50,
    batch_size: int = 32,
    lr: float = 3e-3,
    num_train: int = 20000,
    seed: int = 0,
) -> Path:
    """Fine-tune ``model`` on ``task`` (chat SFT on the answer) until it answers from the full cache; save it.

    Every ``check_every`` steps the greedy full-cache accuracy on ``num_check`` held-out prompts is measured;
    training stops at the first check reaching ``target_accuracy`` (or after ``max_steps``, with a warning). The
    learning rate is constant after a 50-step warm-up: the accuracy jumps suddenly after a seed-dependent number of
    steps, and a decaying schedule can stall just before it (seen: 1.0 after a 300-step cosine run, 0.21 after a
    400-step one, same seed). ``directory/retrieval_training.json`` records the checks. Defaults: the one-digit
    single needle in 40 filler words (``{"haystack_words": 40, "value_digits": 1}``). Returns ``directory``.
    """
    from lightning_llm.datamodules.needle import NeedleDataModule
    from lightning_llm.modules.causal_lm import CausalLMModule

    if not 0.0 < target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in (0, 1], got {target_accuracy}")
    if check_every < 1 or num_check < 1 or max_steps < 1:
        raise ValueError("max_steps, check_every and num_check must be >= 1")
    kwargs = {"haystack_words": 40, "value_digits": 1} if task_kwargs is None else dict(task_kwargs)
    L.seed_everything(seed, verbose=False)
    data = NeedleDataModule(
        task=task,
        task_kwargs=kwargs,
        num_train=num_train,
        num_val=num_check,
        batch_size=batch_size,
        max_length=1024,
        seed=seed,
    )
    warmup = min(50, max_steps // 10)
    module = CausalLMModule(
        model, lr=lr, warmup_ratio=warmup / max_steps, min_lr_ratio=1.0, save_dir=str(directory)
    )
    stopper = _StopAtAccuracy(data, target_accuracy, check_every)
    trainer = quiet_trainer(max_steps, callbacks=[stopper])
    trainer.fit(module, data)
    history = stopper.history
    if not history or history[-1]["step"] != trainer.global_step:
        history.append({"step": trainer.global_step, "accuracy": stopper.check(module)})
    final = history[-1]["accuracy"]
    if final < target_accuracy:
        rank_zero_warn(
            f"train_retrieval_backbone: full-cache accuracy {final:.3f} < {target_accuracy} after "
            f"{trainer.global_step} steps (raise max_steps or change the seed)"
        )
    (Path(directory) / "retrieval_training.json").write_text(
        json.dumps({"task": task, "task_kwargs": kwargs, "seed": seed, "checks": history}, indent=2)
    )
    return Path(directory)


class _StopAtAccuracy(L.Callback):
    """Every ``every`` steps, the full-cache accuracy on the DataModule's held-out prompts; stop at ``target``."""

    def __init__(self, data: Any, target: float, every: int) -> None:
        self.data, self.target, self.every = data, target, every
        self.history: list[dict[str, float]] = []

    def check(self, module: L.LightningModule) -> float:
        return accuracy_under_budget(
            module.model, module.tokenizer, self.data.task, self.data.val_examples, FullCache()
        ).accuracy

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        accuracy = self.check(pl_module)
        self.history.append({"step": trainer.global_step, "accuracy": accuracy})
        if accuracy >= self.target:
            trainer.should_stop = True


@dataclass
class BudgetResult:
    """Accuracy of one policy at one budget, with the cache accounting of the run.

    ``budgets``/``kept``: the budget and the mean tokens kept per layer at the end, per example;
    ``peak_cache_bytes``: the largest K/V bytes stored at once, over the examples (per generation, batch
    included); ``evicted_fraction``: mean fraction of the tokens seen that were evicted.
    """

    accuracy: float
    correct: list[float] = field(repr=False)
    budgets: list[int] = field(repr=False)
    peak_cache_bytes: int = 0
    evicted_fraction: float = 0.0
    completions: list[str] = field(default_factory=list, repr=False)


@torch.no_grad()
def accuracy_under_budget(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    examples: Sequence[Example],
    policy: EvictionPolicy,
    *,
    budget: int | None = None,
    budget_ratio: float | None = None,
    memory: Any = None,
    max_new_tokens: int = 6,
    batch_size: int = 32,
    system_prompt: str | None = None,
    scorer: Callable[[str, Example], float] | None = None,
) -> BudgetResult:
    """Greedy accuracy of ``model`` on ``examples`` when its KV cache keeps ``budget`` tokens per layer (or
    ``ceil(budget_ratio · prompt tokens)``, at least ``sinks + window``), chosen by ``policy``.

    Prompts are rendered with the chat template as in training, sorted by length and run ``batch_size`` at a time,
    left-padded (prompts of equal length only with a ``memory``, which padding does not support); with
    ``budget_ratio`` a batch's budget is the ratio of its longest prompt (sorting keeps a batch's lengths close),
    the same for every policy. Generation stops at the tokenizer's eos. ``scorer(completion,
    example)`` replaces ``task.score`` (e.g. for a model that does not use the task's answer format).
    """
    if (budget is None) == (budget_ratio is None) and policy.evicts:
        raise ValueError("give exactly one of budget and budget_ratio")
    if budget_ratio is not None and not 0.0 < budget_ratio <= 1.0:
        raise ValueError(f"budget_ratio must be in (0, 1], got {budget_ratio}")
    device = next(model.parameters()).device
    encoded = [
        tokenizer(render_prompt(tokenizer, ex.prompt, system_prompt), add_special_tokens=False)["input_ids"]
        for ex in examples
    ]
    order = sorted(range(len(examples)), key=lambda index: (len(encoded[index]), index))
    floor = policy.sinks + policy.window
    correct = [0.0] * len(examples)
    budgets = [0] * len(examples)
    completions = [""] * len(examples)
    peak, evicted_fraction = 0, 0.0
    eos = tokenizer.eos_token_id
    score = task.score if scorer is None else scorer
    if memory is None:
        chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    else:  # a latent memory needs unpadded batches: prompts of equal length only
        by_length: dict[int, list[int]] = {}
        for i in order:
            by_length.setdefault(len(encoded[i]), []).append(i)
        chunks = [
            g[start : start + batch_size]
            for g in by_length.values()
            for start in range(0, len(g), batch_size)
        ]
    for chunk in chunks:
        length = max(len(encoded[i]) for i in chunk)
        if not policy.evicts:
            row_budget = None
        elif budget is not None:
            row_budget = int(budget)
        else:
            row_budget = max(floor, math.ceil(budget_ratio * length))
        ids = torch.full((len(chunk), length), eos, dtype=torch.long)
        mask = torch.zeros((len(chunk), length), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, length - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, length - len(encoded[i]) :] = 1
        out = generate_with_budget(
            model,
            ids.to(device),
            mask.to(device) if not bool(mask.all()) else None,
            policy=policy,
            budget=row_budget,
            max_new_tokens=max_new_tokens,
            memory=memory,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        peak = max(peak, out.peak_cache_bytes)
        stats = out.cache_stats[0]
        evicted_fraction += len(chunk) * stats.evicted / max(stats.seen, 1)
        texts = tokenizer.batch_decode(out.sequences[:, length:], skip_special_tokens=False)
        for i, text in zip(chunk, texts, strict=True):
            text = text.split(tokenizer.eos_token)[0] if tokenizer.eos_token else text
            completions[i] = text
            correct[i] = float(score(text, examples[i]))
            budgets[i] = row_budget if row_budget is not None else len(encoded[i]) + max_new_tokens
    n = max(len(examples), 1)
    return BudgetResult(
        accuracy=sum(correct) / n,
        correct=correct,
        budgets=budgets,
        peak_cache_bytes=peak,
        evicted_fraction=evicted_fraction / n,
        completions=completions,
    )
