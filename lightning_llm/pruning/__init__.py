"""Structured pruning of trained models: MoE expert pruning, RaGEP and three baselines (docs/methods.md §15).

One file per job: :mod:`.statistics` (one calibration pass: routing and every expert's output per layer),
:mod:`.budgets` (effective ranks, experts kept per layer), :mod:`.base` (the :class:`ExpertSelection`
interface), one file per selection method (:mod:`.ragep`, :mod:`.frequency`, :mod:`.reap`, :mod:`.naee`),
:mod:`.selection` (the methods by name, :func:`select_experts`) and :mod:`.surgery` (:func:`prune_experts`).
The Lightning callback that runs all of it at the end of ``fit`` is
:class:`lightning_llm.callbacks.ExpertPruning`.
"""

from lightning_llm.backbones.moe import moe_blocks
from lightning_llm.pruning.base import ExpertSelection, ScoredSelection
from lightning_llm.pruning.budgets import check_keep_ratio, effective_rank, layer_budgets
from lightning_llm.pruning.frequency import FrequencySelection
from lightning_llm.pruning.naee import NAEESelection, naee_reconstruction_error
from lightning_llm.pruning.ragep import RaGEPSelection, ragep_select
from lightning_llm.pruning.reap import REAPSelection
from lightning_llm.pruning.selection import METHODS, SELECTIONS, make_selection, select_experts
from lightning_llm.pruning.statistics import MoELayerStats, collect_moe_statistics, route
from lightning_llm.pruning.surgery import prune_experts

__all__ = [
    "METHODS",
    "SELECTIONS",
    "ExpertSelection",
    "FrequencySelection",
    "MoELayerStats",
    "NAEESelection",
    "REAPSelection",
    "RaGEPSelection",
    "ScoredSelection",
    "check_keep_ratio",
    "collect_moe_statistics",
    "effective_rank",
    "layer_budgets",
    "make_selection",
    "moe_blocks",
    "naee_reconstruction_error",
    "prune_experts",
    "ragep_select",
    "route",
    "select_experts",
]
