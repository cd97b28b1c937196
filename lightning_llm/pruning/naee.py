r"""NAEE baseline (Lu et al., 2024): keep the subset of experts that best reconstructs the layer's output.

The kept set :math:`S` minimises
:math:`\frac1N\sum_t \lVert \sum_e g_e(x_t) f_e(x_t) - \sum_{e\in S} g^S_e(x_t) f_e(x_t)\rVert^2` over the
calibration tokens, where :math:`g^S` is the routing of the *pruned* router (softmax over the kept experts'
logits, top-:math:`k`, renormalised when the router renormalises).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from lightning_llm.pruning.base import ExpertSelection
from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["NAEESelection", "naee_reconstruction_error"]


def naee_reconstruction_error(stats: MoELayerStats, kept: Sequence[int]) -> float:
    """Mean squared norm of the layer's output change on the calibration tokens when only ``kept`` remain."""
    diff = stats.layer_output() - stats.layer_output(kept)
    return float(diff.double().square().sum(-1).mean())


class NAEESelection(ExpertSelection):
    r"""The subset with the smallest :func:`naee_reconstruction_error`: exhaustive search when
    :math:`\binom{E}{b}` is at most ``max_subsets``, otherwise greedy backward elimination (drop, one at a time,
    the expert whose removal raises the error least).

    Args:
        max_subsets: Largest number of subsets searched exhaustively.
    """

    name = "naee"

    def __init__(self, max_subsets: int = 5000) -> None:
        self.max_subsets = int(max_subsets)

    def choose(self, stats: MoELayerStats, budget: int) -> list[int]:
        experts = list(range(stats.num_experts))
        if math.comb(len(experts), budget) <= self.max_subsets:
            best = min(
                itertools.combinations(experts, budget), key=lambda s: naee_reconstruction_error(stats, s)
            )
            return list(best)
        kept = experts
        while len(kept) > budget:
            kept = min(
                ([e for e in kept if e != drop] for drop in kept),
                key=lambda s: naee_reconstruction_error(stats, s),
            )
        return kept
