"""Structured pruning of trained models: MoE expert pruning (RaGEP and baselines)."""

from lightning_llm.pruning.callback import ExpertPruning
from lightning_llm.pruning.experts import (
    METHODS,
    MoELayerStats,
    collect_moe_statistics,
    effective_rank,
    layer_budgets,
    load_pruned_moe,
    moe_blocks,
    naee_reconstruction_error,
    prune_experts,
    ragep_select,
    select_experts,
)
from lightning_llm.pruning.tiny_moe import build_tiny_moe

__all__ = [
    "METHODS",
    "ExpertPruning",
    "MoELayerStats",
    "build_tiny_moe",
    "collect_moe_statistics",
    "effective_rank",
    "layer_budgets",
    "load_pruned_moe",
    "moe_blocks",
    "naee_reconstruction_error",
    "prune_experts",
    "ragep_select",
    "select_experts",
]
