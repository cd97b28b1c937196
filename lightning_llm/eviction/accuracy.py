"""Greedy accuracy of a model on task examples when its KV cache keeps a budget (docs/methods.md §11).

:func:`accuracy_under_budget` generates through :func:`~lightning_llm.eviction.generate_with_budget` for every
example and scores the answers with the task's verifier; the budget is an absolute token count or a fraction of
each prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_llm.datamodules.sources import render_prompt
from lightning_llm.datamodules.tasks import Task
from lightning_llm.eviction.base import EvictionPolicy
from lightning_llm.eviction.generate import generate_with_budget
from lightning_llm.types import Example

__all__ = ["BudgetResult", "accuracy_under_budget"]


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
