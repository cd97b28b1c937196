"""The expert-selection methods by name: a registry, and :func:`select_experts` that dispatches through it."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from lightning_llm.pruning.base import ExpertSelection
from lightning_llm.pruning.frequency import FrequencySelection
from lightning_llm.pruning.naee import NAEESelection
from lightning_llm.pruning.ragep import RaGEPSelection
from lightning_llm.pruning.reap import REAPSelection
from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["METHODS", "SELECTIONS", "Method", "make_selection", "select_experts"]

#: Selection classes by method name; register a new method by adding its class here.
SELECTIONS: dict[str, type[ExpertSelection]] = {
    cls.name: cls for cls in (RaGEPSelection, FrequencySelection, REAPSelection, NAEESelection)
}
#: The built-in methods: RaGEP and the three baselines.
METHODS = ("ragep", "frequency", "reap", "naee")
Method = Literal["ragep", "frequency", "reap", "naee"]


def make_selection(method: str, **options: Any) -> ExpertSelection:
    """The registered selection ``method`` built with ``options`` (its constructor's arguments).

    Raises ``ValueError`` for an unknown method or an option the method does not take.
    """
    if method not in SELECTIONS:
        raise ValueError(f"unknown method {method!r}; choose one of {tuple(SELECTIONS)}")
    cls = SELECTIONS[method]
    unknown = sorted(set(options) - set(inspect.signature(cls).parameters))
    if unknown:
        raise ValueError(f"options {unknown} do not apply to method={method!r}")
    return cls(**options)


def select_experts(method: Method, stats: MoELayerStats, budget: int, **options: Any) -> list[int]:
    """Indices (sorted) of the ``budget`` experts of one layer that ``method`` keeps.

    Args:
        method: A name in :data:`SELECTIONS`: ``"ragep"``, ``"frequency"``, ``"reap"`` or ``"naee"``.
        stats: The layer's calibration statistics.
        budget: Experts to keep, ``1 <= budget <= E``.
        **options: The method's options: ``alpha``, ``subspace_energy``, ``max_rank``, ``gate_weighted`` for
            RaGEP (:class:`~lightning_llm.pruning.ragep.RaGEPSelection`), ``max_subsets`` for NAEE.

    Ties (frequency, REAP) go to the lower index.
    """
    return make_selection(method, **options).select(stats, budget)
