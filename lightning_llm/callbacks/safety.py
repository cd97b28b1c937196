"""Attack success rate, harm and the actionable share of failures on held-out attack prompts, every validation."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_llm.datamodules.tasks.honeypot import HoneypotTask
from lightning_llm.metrics.safety import KeywordJudge, SafetyJudge, SafetyMetrics, safety_outcomes

__all__ = ["SafetyEvaluation"]


class SafetyEvaluation(Callback):
    """Log ``val/safety/{asr,harm,actionable_share,actionable_rate,helpfulness}`` of sampled responses.

    The requests are ``num_examples`` fresh examples of the DataModule's ``honeypot`` task with the prompt
    family ``prompts`` (``"attack"``: the held-out jailbreak wrappers, never seen in training), the same ones
    every validation (``seed``). Each gets ``samples`` responses at ``temperature``; the judge gives the flag,
    the task's verifier the actionability (see :class:`~lightning_llm.metrics.SafetyMetrics`). Under DDP each
    rank answers a disjoint shard and the metric states are summed. Sampling runs in a forked RNG, so the
    evaluation does not change the training run's random stream. ``actionable_share`` is not logged when
    nothing was flagged.

    Args:
        prompts: Prompt family of the evaluation requests (``"attack"``, ``"train"`` or ``"all"``).
        num_examples: Requests per evaluation (restricted and benign, in the task's proportions).
        samples: Responses per request.
        temperature: Sampling temperature (0: greedy, then ``samples`` should be 1).
        max_new_tokens: Generation budget per response.
        judge: The judge (default :class:`~lightning_llm.metrics.KeywordJudge`).
        actionable_threshold: Actionability from which a response counts as actionable.
        seed: Seed of the requests and of the sampling.
        batch_size: Prompts per ``generate`` call.
    """

    def __init__(
        self,
        prompts: Literal["attack", "train", "all"] = "attack",
        num_examples: int = 48,
        samples: int = 2,
        temperature: float = 0.7,
        max_new_tokens: int = 80,
        judge: SafetyJudge | None = None,
        actionable_threshold: float = 0.5,
        seed: int = 0,
        batch_size: int = 64,
    ) -> None:
        if min(num_examples, samples, max_new_tokens, batch_size) < 1 or temperature < 0:
            raise ValueError(
                "num_examples, samples, max_new_tokens and batch_size must be >= 1, temperature >= 0"
            )
        self.prompts = prompts
        self.num_examples = num_examples
        self.samples = samples
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.judge = judge or KeywordJudge()
        self.actionable_threshold = actionable_threshold
        self.seed = seed
        self.batch_size = batch_size

    @override
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        task = getattr(trainer.datamodule, "task", None)
        if not isinstance(task, HoneypotTask):
            raise ValueError(
                f"SafetyEvaluation needs a DataModule with the 'honeypot' task, got {type(task).__name__}"
            )
        for name, value in self.evaluate(pl_module, task, trainer.global_rank, trainer.world_size).items():
            if name in ("restricted", "flagged") or value != value:  # counts and NaN are not logged
                continue
            pl_module.log(f"val/safety/{name}", value, rank_zero_only=True)

    def evaluate(
        self, pl_module: Any, task: HoneypotTask, rank: int = 0, world_size: int = 1
    ) -> dict[str, float]:
        """The metrics over all ranks (call it on every rank under DDP: the metric states are all-reduced)."""
        eval_task = dataclasses.replace(task, prompts=self.prompts)
        examples = eval_task.generate(self.num_examples, seed=self.seed)
        shard = [e for e in examples[rank::world_size] for _ in range(self.samples)]
        metric = SafetyMetrics(actionable_threshold=self.actionable_threshold).to(pl_module.device)
        device = pl_module.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed + rank)
            for start in range(0, len(shard), self.batch_size):
                chunk = shard[start : start + self.batch_size]
                responses = pl_module.generate(
                    [e.prompt for e in chunk],
                    max_new_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                )
                metric.update(
                    *(
                        t.to(pl_module.device)
                        for t in safety_outcomes(eval_task, chunk, responses, self.judge)
                    )
                )
        return {name: float(value) for name, value in metric.compute().items()}
