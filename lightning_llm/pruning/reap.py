"""REAP baseline (Lasby et al., 2025): keep the experts with the largest mean gated output norm."""

from __future__ import annotations

from torch import Tensor

from lightning_llm.pruning.base import ScoredSelection
from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["REAPSelection"]


class REAPSelection(ScoredSelection):
    r"""Score = :math:`\frac{1}{|X_e|}\sum_{x\in X_e} g_e(x)\,\lVert f_e(x)\rVert_2` over the calibration tokens
    :math:`X_e` routed to expert :math:`e` (0 for an expert no token was routed to)."""

    name = "reap"

    def score(self, stats: MoELayerStats) -> Tensor:
        gates = stats.gates().double()  # [N, E]
        norms = stats.expert_outputs.double().norm(dim=-1).T  # [N, E]
        routed = (gates > 0).sum(0).clamp(min=1)
        return (gates * norms).sum(0) / routed
