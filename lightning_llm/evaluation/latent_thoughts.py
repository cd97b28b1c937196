"""LT-Tuning vs Coconut vs explicit CoT on a backbone with LoRA, at an equal number of optimiser steps.

Three arms are trained from the same backbone on 3-operand 1-digit arithmetic (``ArithmeticTask``, evaluated
left to right) and scored on the same held-out prompts:

- ``cot``: SFT on explicit chains of thought (``<think>3 + 4 = 7; 7 + 5 = 12</think><answer>12</answer>``).
- ``coconut``: ``latent_steps`` untrained ``<thinking>`` placeholders per reasoning step instead of the chain,
  fed back at α = 1 (the hidden state), and that fixed count forced at generation (``num_latents``).
- ``lt_tuning``: :class:`~lightning_llm.callbacks.LatentThoughtsCurriculum` with one epoch per stage (CoT, then
  ``<thinking>`` inserted before low-confidence tokens at α = 1, then the fusion at the curriculum's α, 0.6),
  and dynamic ``<thinking>`` switching at generation (a latent step whenever the argmax is ``<thinking>``).

Every arm trains ``3 × epoch`` steps on the same ``num_train`` items (the curriculum's rebuilt items are as
many), with LoRA on the attention and MLP projections. With ``train_thinking_row=True`` the
``<thinking>`` row of the input embedding, which is tied to the LM head in SmolLM2, is trainable too: a
gradient hook zeroes every other row's gradient and weight decay is 0, so all other rows stay exactly the
pretrained ones (AdamW's update of a parameter entry whose gradients were always 0 is 0). The row is
initialised when the embeddings are resized (transformers' ``mean_resizing``: a draw from a normal with the
pretrained rows' mean and covariance).

:func:`train_arm` trains one arm, :func:`evaluate` scores it (greedy accuracy, explicit tokens and latent steps
per answer, and the collapse of the latents fed at generation: :func:`~lightning_llm.modules.latent_collapse`,
mean pairwise cosine and effective rank of each answer's chain of latents), :func:`summarize` gives the mean and
range over seeds per arm. ``experiments/latent_thoughts.py`` runs the comparison on SmolLM2.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch

from lightning_llm.callbacks import LatentThoughtsCurriculum
from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules import LatentThoughtsModule, latent_collapse
from lightning_llm.trainer import quiet_trainer

__all__ = ["ARMS", "evaluate", "summarize", "train_arm"]

ARMS = ("cot", "coconut", "lt_tuning")


class _StudyModule(LatentThoughtsModule):
    """:class:`LatentThoughtsModule` whose ``<thinking>`` embedding row stays trainable under LoRA (see the module
    docstring); with ``train_thinking_row=False`` it is the plain module."""

    def __init__(self, *args: Any, train_thinking_row: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_thinking_row = train_thinking_row

    def prepare_model(self, model: Any) -> Any:
        model = super().prepare_model(model)
        if self.train_thinking_row:
            if self.hparams.weight_decay != 0:
                raise ValueError("train_thinking_row needs weight_decay=0 (decay would move the frozen rows)")
            weight = model.get_input_embeddings().weight
            self.initial_thinking_row = weight[self.thinking_id].detach().clone()
            weight.requires_grad_(True)
            row = torch.zeros(weight.shape[0], 1, dtype=weight.dtype)
            row[self.thinking_id] = 1.0
            weight.register_hook(lambda grad: grad * row.to(grad.device))
        return model


class _InsertionLog(L.Callback):
    """Records the curriculum's ``<thinking>`` insertions at each stage change (it keeps only the last)."""

    def __init__(self, curriculum: LatentThoughtsCurriculum) -> None:
        self.curriculum = curriculum
        self.inserted: list[dict[str, float]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.curriculum.stage > len(self.inserted) + 1:
            items = len(trainer.datamodule.train_items)
            self.inserted.append(
                {
                    "stage": self.curriculum.stage,
                    "inserted": self.curriculum.inserted,
                    "per_item": self.curriculum.inserted / items,
                }
            )


def _task(arm: str, ops: str, latent_steps: int, digits: int = 1, operands: int = 3) -> dict[str, Any]:
    task = {"digits": digits, "operands": operands, "ops": ops}
    return {**task, "latent_steps": latent_steps} if arm == "coconut" else {**task, "chain_of_thought": True}


def train_arm(
    arm: str,
    *,
    model: str,
    seed: int,
    num_train: int,
    num_eval: int,
    batch_size: int,
    ops: str,
    latent_steps: int,
    lora_r: int,
    lr: float,
    train_thinking_row: bool,
    thresholds: tuple[float, float] = (0.3, 0.2),
    digits: int = 1,
    operands: int = 3,
    stage_epochs: tuple[int, int] = (1, 1),
    max_length: int = 128,
    max_steps: int = -1,
    trainer_kwargs: dict[str, Any] | None = None,
) -> tuple[LatentThoughtsModule, ChatSFTDataModule, dict[str, Any]]:
    """Train one arm for ``1 + sum(stage_epochs)`` epochs (``max_steps`` caps them, for timing); returns module,
    data and its record.

    The data (train items and held-out prompts) is drawn with seed 0 for every arm and seed; ``seed`` sets the
    LoRA initialisation and the batch order. ``thresholds`` are the curriculum's confidence thresholds τ entering
    stages 2 and 3 (LT-Tuning only). The task is ``operands`` numbers of ``digits`` digits; Coconut takes
    ``latent_steps`` latents per reasoning step (``operands - 1`` steps). ``trainer_kwargs`` go to the Trainer
    (e.g. ``accelerator="gpu"``, ``precision="bf16-mixed"``).
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    L.seed_everything(seed, verbose=False)
    kwargs: dict[str, Any] = {"alpha": 1.0} if arm != "lt_tuning" else {"alpha": 0.55}
    if arm == "coconut":
        kwargs["num_latents"] = latent_steps * (operands - 1)  # one reasoning step per operation
    if arm == "cot":
        kwargs["max_latent_steps"] = 0  # plain CoT decoding: never switch to a latent
    module = _StudyModule(
        model,
        lr=lr,
        weight_decay=0.0,
        lora=LoRAConfig(r=lora_r, alpha=2.0 * lora_r),
        train_thinking_row=train_thinking_row,
        **kwargs,
    )
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs=_task(arm, ops, latent_steps, digits, operands),
        num_train=num_train,
        num_val=num_eval,
        batch_size=batch_size,
        max_length=max_length,
        seed=0,
    )
    callbacks: list[L.Callback] = []
    log = None
    if arm == "lt_tuning":
        curriculum = LatentThoughtsCurriculum(
            stage_epochs=(1, 1), thresholds=thresholds, batch_size=batch_size
        )
        log = _InsertionLog(curriculum)
        callbacks = [curriculum, log]
    trainer = quiet_trainer(
        max_steps,
        max_epochs=1 + sum(stage_epochs),
        reload_dataloaders_every_n_epochs=1,
        callbacks=callbacks,
        **(trainer_kwargs or {}),
    )
    start, cpu = time.perf_counter(), time.process_time()
    trainer.fit(module, data)
    record: dict[str, Any] = {
        "steps": int(trainer.global_step),
        "train_seconds": round(time.perf_counter() - start, 1),
        "train_cpu_seconds": round(time.process_time() - cpu, 1),
        "final_alpha": float(module.hparams.alpha),
    }
    if log is not None:
        record["curriculum"] = log.inserted
    module.eval()
    return module, data, record


@torch.no_grad()
def evaluate(
    module: LatentThoughtsModule,
    data: ChatSFTDataModule,
    *,
    max_new_tokens: int = 64,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Greedy latent decoding of the held-out prompts: accuracy, tokens and latent steps per answer, collapse."""
    examples = list(data.val_examples)
    texts: list[str] = []
    tokens: list[int] = []
    steps: list[int] = []
    chains: list[torch.Tensor] = []
    start, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(examples), batch_size):
        chunk = examples[first : first + batch_size]
        out = module.generate_latent(
            **module.encode_prompts([ex.prompt for ex in chunk]), max_new_tokens=max_new_tokens
        )
        texts += out["texts"]
        tokens += out["explicit_tokens"]
        steps += out["latent_steps"]
        chains += [c.float().cpu() for c in out["latents"] if c.shape[0] >= 2]
    stats: dict[str, Any] = {"mean_cosine": float("nan"), "effective_rank": float("nan"), "chains": 0}
    if chains:
        width = max(c.shape[0] for c in chains)
        padded = torch.zeros(len(chains), width, chains[0].shape[1])
        keep = torch.zeros(len(chains), width, dtype=torch.bool)
        for i, chain in enumerate(chains):
            padded[i, : len(chain)], keep[i, : len(chain)] = chain, True
        stats = latent_collapse(padded, keep)
    n = len(examples)
    return {
        "accuracy": sum(data.task.score(t, ex) for t, ex in zip(texts, examples, strict=True)) / n,
        "explicit_tokens": sum(tokens) / n,
        "latent_steps": sum(steps) / n,
        "latent_cosine": stats["mean_cosine"],
        "latent_effective_rank": stats["effective_rank"],
        "latent_chains": stats["chains"],
        "examples": [{"prompt": examples[i].prompt, "completion": texts[i]} for i in range(min(3, n))],
        "eval_seconds": round(time.perf_counter() - start, 1),
        "eval_cpu_seconds": round(time.process_time() - cpu, 1),
    }


_SUMMARY_KEYS = ("accuracy", "explicit_tokens", "latent_steps", "latent_cosine", "latent_effective_rank")


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per arm, the mean and the ``[min, max]`` over seeds of each summary figure (None where no seed has one:
    an arm that fed no latent chain has no collapse figures)."""
    mean: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, list[float] | None]] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rows = [r for r in runs if r["arm"] == arm]
        mean[arm], spread[arm] = {}, {}
        for key in _SUMMARY_KEYS:
            values = [r[key] for r in rows if r[key] is not None and not math.isnan(r[key])]
            mean[arm][key] = statistics.mean(values) if values else None
            spread[arm][key] = [min(values), max(values)] if values else None
    return {"mean": mean, "range": spread}
