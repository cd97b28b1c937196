"""Group-relative advantages: each completion's reward against the others sampled for the same prompt."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["group_advantages"]


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    scale: Literal["group", "batch", "none"],
    eps: float = 1e-4,
    batch_std: Tensor | None = None,
) -> Tensor:
    r"""Sequence advantages :math:`A_i = (r_i - \bar r_{g(i)}) / s`.

    ``s`` is the (unbiased) std of the row's group (``"group"``, as in DeepSeekMath/TRL), of the whole batch
    (``"batch"``; pass ``batch_std`` when the batch spans several processes) or 1 (``"none"``, as in Dr. GRPO).
    """
    num_groups = int(group_ids.max()) + 1
    counts = torch.bincount(group_ids, minlength=num_groups).to(rewards.dtype)
    means = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, group_ids, rewards
    )
    means = means / counts
    centred = rewards - means[group_ids]
    if scale == "none":
        return centred
    if scale == "batch":
        return centred / ((rewards.std() if batch_std is None else batch_std) + eps)
    sq = torch.zeros_like(means).index_add_(0, group_ids, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[group_ids] + eps)
