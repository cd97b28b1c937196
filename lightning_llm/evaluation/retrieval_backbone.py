"""A retrieval backbone for the accuracy-vs-budget evaluation of docs/methods.md §11.

:func:`train_retrieval_backbone` fine-tunes a backbone (``"tiny"`` by default, randomly initialised) on a
long-context task of :class:`~lightning_llm.datamodules.NeedleDataModule` until it answers from the full cache,
and saves it (``load_backbone(directory)`` reloads it); :func:`~lightning_llm.eviction.accuracy_under_budget`
then scores it under each policy and budget.

On a CPU in minutes the tiny backbone learns the single needle with a one-digit value (``needle``,
``value_digits=1``, 40 filler words): full-cache accuracy jumps from chance to 100% after a seed-dependent number of
steps (250 of batch 32 at lr 3e-3 at seed 0, one thread). It does not learn the content-matched tasks
(``multikey_needle``, ``associative_recall``) at this size; docs/methods.md §11 records the measurements.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_llm.datamodules.needle import NeedleDataModule
from lightning_llm.eviction import FullCache, accuracy_under_budget
from lightning_llm.modules.causal_lm import CausalLMModule
from lightning_llm.trainer import quiet_trainer

__all__ = ["train_retrieval_backbone"]


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
