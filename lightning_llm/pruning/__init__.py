"""Structured pruning of trained models: MoE expert pruning (RaGEP and baselines)."""

from lightning_llm.backbones.moe import moe_blocks
from lightning_llm.pruning.callback import ExpertPruning
from lightning_llm.pruning.experts import (
    METHODS,
    MoELayerStats,
    collect_moe_statistics,
    effective_rank,
    layer_budgets,
    naee_reconstruction_error,
    prune_experts,
    ragep_select,
    select_experts,
)

__all__ = [
    "METHODS",
    "ExpertPruning",
    "MoELayerStats",
    "collect_moe_statistics",
    "effective_rank",
    "layer_budgets",
    "moe_blocks",
    "naee_reconstruction_error",
    "prune_experts",
    "ragep_select",
    "select_experts",
]
