"""The expert-selection interface: which experts of one MoE layer a method keeps, from its statistics."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor

from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["ExpertSelection", "ScoredSelection", "check_budget"]


class ExpertSelection(ABC):
    """A method that keeps ``budget`` experts of one MoE layer, given the layer's calibration statistics.

    Subclasses implement :meth:`choose`; :meth:`select` checks the budget and returns the choice sorted. Options
    of a method are its constructor's arguments.
    """

    #: The method's name in :data:`lightning_llm.pruning.selection.SELECTIONS`.
    name: ClassVar[str]

    def select(self, stats: MoELayerStats, budget: int) -> list[int]:
        """Indices (sorted) of the ``budget`` experts kept, ``1 <= budget <= E``."""
        check_budget(budget, stats.num_experts)
        return sorted(int(e) for e in self.choose(stats, budget))

    @abstractmethod
    def choose(self, stats: MoELayerStats, budget: int) -> Sequence[int]:
        """``budget`` distinct expert indices, in any order (``budget`` is already checked)."""


class ScoredSelection(ExpertSelection):
    """Keeps the ``budget`` experts with the highest :meth:`score` (ties: the lower index)."""

    @abstractmethod
    def score(self, stats: MoELayerStats) -> Tensor:
        """``[E]`` one score per expert; higher is kept first."""

    def choose(self, stats: MoELayerStats, budget: int) -> list[int]:
        score = self.score(stats)
        return sorted(range(stats.num_experts), key=lambda e: (-float(score[e]), e))[:budget]


def check_budget(budget: int, num_experts: int) -> None:
    """Raise ``ValueError`` unless ``1 <= budget <= num_experts``."""
    if not 1 <= budget <= num_experts:
        raise ValueError(f"budget must be in [1, {num_experts}], got {budget}")
