r"""Held-out next-token negative log-likelihood and perplexity of a causal LM.

.. math::  \mathrm{PPL} = \exp\Big(\frac{1}{N}\sum_{b,t:\ y_{b,t+1} \ne -100} -\log p(y_{b,t+1} \mid y_{b,\le t})\Big)

over batches in the library's collate format (``input_ids``, ``attention_mask``, optional ``labels`` with
``-100`` = not scored; without ``labels`` every attended token after the first is scored).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llm.types import IGNORE_INDEX

__all__ = ["perplexity", "token_nll", "token_nll_sum"]


def token_nll_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed next-token NLL (fp64) of ``labels [b, T]`` (``-100`` ignored) under ``logits [b, T, V]``."""
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction="sum").double()


@torch.no_grad()
def token_nll(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> tuple[float, int]:
    """``(summed NLL in nats, scored tokens)`` of ``model`` (run in eval mode, restored after) on ``batches``."""
    was_training = model.training
    model.eval()
    device = next(iter(model.buffers()), next(model.parameters())).device
    total, count = 0.0, 0
    try:
        for batch in batches:
            input_ids = batch["input_ids"].to(device)
            mask = batch.get("attention_mask")
            mask = torch.ones_like(input_ids) if mask is None else mask.to(device)
            labels = batch.get("labels")
            labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX) if labels is None else labels.to(device)
            logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
            total += float(token_nll_sum(logits, labels))
            count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    return total, count


def perplexity(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> float:
    """``exp`` of the mean next-token NLL over the scored tokens of ``batches``."""
    total, count = token_nll(model, batches)
    if count == 0:
        raise ValueError("no scored tokens in the batches (all labels are -100)")
    return math.exp(total / count)
