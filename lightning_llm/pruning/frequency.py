"""Frequency baseline: keep the experts the router picks most often."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llm.pruning.base import ScoredSelection
from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["FrequencySelection"]


class FrequencySelection(ScoredSelection):
    """Score = how often the router puts the expert in its top-:math:`k` on the calibration tokens."""

    name = "frequency"

    def score(self, stats: MoELayerStats) -> Tensor:
        return torch.bincount(stats.top_k_index.flatten(), minlength=stats.num_experts).double()
