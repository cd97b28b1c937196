r"""Expert surgery: remove experts from a sparse MoE in place, router and config consistent.

Pruning slices every parameter of a layer's ``experts`` and ``gate`` whose first dimension is :math:`E`
(:mod:`lightning_llm.backbones.moe`), updates the modules' ``num_experts`` and the config
(``num_local_experts`` / ``num_experts``), and caps the router ``top_k`` at the smallest layer's count. HF
configs hold *one* expert count, so a model whose layers keep different counts cannot be rebuilt by a plain
``from_pretrained``: :func:`prune_experts` then records the kept experts in ``config.expert_pruning`` and
``load_backbone`` reloads it (:func:`lightning_llm.backbones.moe.load_moe`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from lightning_llm.backbones.moe import moe_blocks, num_experts, router_top_k, set_router_top_k, slice_experts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["prune_experts"]

_CONFIG_COUNT_KEYS = ("num_local_experts", "num_experts")


@torch.no_grad()
def prune_experts(model: PreTrainedModel, keep: Mapping[int, Sequence[int]]) -> PreTrainedModel:
    """Remove every expert of the MoE layers in ``keep`` not listed there, in place; returns ``model``.

    ``keep`` maps a layer index (as in :func:`~lightning_llm.backbones.moe.moe_blocks`) to the expert indices to
    keep (in their original order); layers not in ``keep`` are left whole. Every parameter of the layer's
    ``experts`` and ``gate`` whose first dimension is the expert count is sliced (expert weights and the router
    rows together), the modules' ``num_experts`` are updated and so is the config (``num_local_experts`` /
    ``num_experts``: the common count, or the largest one when layers differ). The router top-k of every layer
    becomes ``min(top_k, fewest experts in a layer)`` (the config has one ``num_experts_per_tok``). The kept
    original indices are recorded in ``config.expert_pruning["kept"]`` (cumulative over repeated pruning).
    """
    blocks = moe_blocks(model)
    plan: dict[int, list[int]] = {}
    for layer, experts in keep.items():
        if layer not in blocks:
            raise ValueError(f"layer {layer} is not an MoE layer; MoE layers: {sorted(blocks)}")
        count = num_experts(blocks[layer])
        indices = sorted({int(e) for e in experts})
        if not indices:
            raise ValueError(f"layer {layer}: keep at least one expert")
        if indices[0] < 0 or indices[-1] >= count:
            raise ValueError(f"layer {layer}: expert indices must be in [0, {count}), got {indices}")
        plan[layer] = indices
    config = model.config
    record = dict(getattr(config, "expert_pruning", None) or {})
    previous = {int(i): list(v) for i, v in (record.get("kept") or {}).items()}
    for layer, indices in plan.items():
        original = previous.get(layer, list(range(num_experts(blocks[layer]))))
        slice_experts(blocks[layer], indices)
        previous[layer] = [original[i] for i in indices]
    counts = {layer: num_experts(block) for layer, block in blocks.items()}
    top_k = min(router_top_k(blocks[next(iter(blocks))]), min(counts.values()))
    set_router_top_k(blocks, top_k)
    count = max(counts.values())
    for key in _CONFIG_COUNT_KEYS:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, count)
    if hasattr(config, "num_experts_per_tok"):
        config.num_experts_per_tok = top_k
    for key, value in (("num_experts", count), ("num_experts_per_tok", top_k)):
        if isinstance(getattr(model, key, None), int):
            setattr(model, key, value)
    record["kept"] = {str(i): v for i, v in sorted(previous.items())}
    record["uniform"] = len(set(counts.values())) == 1
    config.expert_pruning = record
    return model
