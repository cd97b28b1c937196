"""Sparse mixture-of-experts structure: finding a decoder's MoE blocks, slicing experts, loading pruned MoEs.

transformers 5 stores a layer's experts fused, as 3-D parameters ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]`` under ``mlp`` (Mixtral's legacy ``block_sparse_moe.experts.{i}.w1/w2/w3`` layout is
converted on load and written back on save). Hugging Face configs hold *one* expert count, so a model whose
layers keep different numbers of experts (after expert pruning) records the kept experts in
``config.expert_pruning`` and is reloaded by :func:`load_moe` (``load_backbone`` does this for any directory).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "is_nonuniform_moe",
    "load_moe",
    "moe_blocks",
    "num_experts",
    "router_normalizes",
    "router_top_k",
    "set_router_top_k",
    "slice_experts",
]


def moe_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """The sparse MoE blocks of a decoder, by layer index: modules with a ``gate`` router and ``experts``.

    Found under each decoder layer as ``mlp`` (transformers 5: Mixtral, Qwen2/3-MoE) or ``block_sparse_moe``
    (older Mixtral). Raises ``ValueError`` for a model without any.
    """
    layers = _decoder_layers(model)
    blocks = {}
    for index, layer in enumerate(layers):
        for name in ("mlp", "block_sparse_moe"):
            block = getattr(layer, name, None)
            if block is not None and _is_moe_block(block):
                blocks[index] = block
                break
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no sparse MoE block (a layer `mlp` or `block_sparse_moe` with a `gate` "
            "router and `experts`); expert pruning needs a Mixtral- or Qwen-MoE-style model"
        )
    return blocks


def _decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` decoder stack; not a supported MoE LM"
        )
    return layers


def _is_moe_block(block: nn.Module) -> bool:
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    return isinstance(getattr(gate, "weight", None), Tensor) and isinstance(experts, nn.Module)


def num_experts(block: nn.Module) -> int:
    """Number of routed experts of an MoE block (rows of its router)."""
    return int(block.gate.weight.shape[0])


def router_top_k(block: nn.Module) -> int:
    """Experts per token of an MoE block's router."""
    for owner in (block.gate, block):
        value = getattr(owner, "top_k", None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the router top_k of {type(block).__name__}")


def router_normalizes(block: nn.Module) -> bool:
    """Whether the router renormalises its top-k probabilities (Mixtral always does; Qwen: norm_topk_prob)."""
    for owner in (block.gate, block):
        value = getattr(owner, "norm_topk_prob", None)
        if isinstance(value, bool):
            return value
    return True


def set_router_top_k(blocks: Mapping[int, nn.Module], top_k: int) -> None:
    """Set the experts-per-token of every router in ``blocks`` (where the block or its gate stores one)."""
    for block in blocks.values():
        for owner in (block.gate, block):
            if isinstance(getattr(owner, "top_k", None), int):
                owner.top_k = top_k


def is_nonuniform_moe(directory: str | Path) -> bool:
    """Whether a local checkpoint directory holds an expert-pruned MoE with different expert counts per layer."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return False
    try:
        record = json.loads(config.read_text()).get("expert_pruning") or {}
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(record, dict) and record.get("uniform", True) is False


def slice_experts(block: nn.Module, indices: list[int]) -> None:
    """Keep only experts ``indices`` of ``block``: every expert and router parameter/buffer sliced together."""
    count = num_experts(block)
    index = torch.tensor(indices, dtype=torch.long)
    for module in (block.gate, block.experts):
        if isinstance(module, nn.ModuleList):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim >= 1 and param.shape[0] == count:
                data = param.data.index_select(0, index.to(param.device)).clone()
                setattr(module, name, nn.Parameter(data, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None and buffer.ndim >= 1 and buffer.shape[0] == count:
                module._buffers[name] = buffer.index_select(0, index.to(buffer.device)).clone()
    if isinstance(block.experts, nn.ModuleList):
        block.experts = nn.ModuleList([block.experts[i] for i in indices])
    if isinstance(block.gate, nn.Linear):
        block.gate.out_features = len(indices)
    for module in (block.gate, block.experts, block):
        if isinstance(getattr(module, "num_experts", None), int):
            module.num_experts = len(indices)


def load_moe(directory: str | Path, **kwargs: Any) -> PreTrainedModel:
    """Load a model written by ``save_pretrained`` after expert pruning (``lightning_llm.pruning.prune_experts``), also when its layers keep
    different numbers of experts (which a plain ``from_pretrained`` cannot rebuild from the config).

    Non-uniform layers are loaded with ``ignore_mismatched_sizes``, sliced to their recorded counts and their
    router and expert tensors read from the checkpoint (transformers 5 writes Mixtral experts in the legacy
    ``experts.{i}.w1/w3/w2`` layout and Qwen-MoE in ``experts.{i}.gate_proj/up_proj/down_proj``; both are
    fused back into ``gate_up_proj`` / ``down_proj``). ``kwargs`` go to ``from_pretrained``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    config = AutoConfig.from_pretrained(directory)
    record = getattr(config, "expert_pruning", None) or {}
    if record.get("uniform", True):
        return AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the expected size mismatches would print a load report
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, ignore_mismatched_sizes=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    blocks = moe_blocks(model)
    counts = {int(i): len(v) for i, v in record["kept"].items()}
    tensors = _read_checkpoint(directory)
    for layer, n in counts.items():
        block = blocks[layer]
        if num_experts(block) != n:
            slice_experts(block, list(range(n)))
        _fill_block_from_checkpoint(block, layer, n, tensors)
    if hasattr(config, "num_experts_per_tok"):
        set_router_top_k(blocks, min(config.num_experts_per_tok, min(counts.values())))
    return model


def _read_checkpoint(directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no safetensors checkpoint")
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _fill_block_from_checkpoint(block: nn.Module, layer: int, n: int, tensors: Mapping[str, Tensor]) -> None:
    prefixes = [f"model.layers.{layer}.{name}." for name in ("mlp", "block_sparse_moe")]
    prefix = next((p for p in prefixes if f"{p}gate.weight" in tensors), None)
    if prefix is None:
        raise KeyError(f"layer {layer}: no router weight in the checkpoint under {prefixes}")

    def assign(module: nn.Module, name: str, value: Tensor) -> None:
        old = getattr(module, name)
        if tuple(old.shape) != tuple(value.shape):
            raise ValueError(
                f"layer {layer}: checkpoint {name} has shape {tuple(value.shape)}, expected {tuple(old.shape)}"
            )
        old.data.copy_(value.to(old.dtype))

    assign(block.gate, "weight", tensors[f"{prefix}gate.weight"])
    experts = block.experts
    if isinstance(experts, nn.ModuleList):
        for i, expert in enumerate(experts):
            for name, param in expert.named_parameters():
                param.data.copy_(tensors[f"{prefix}experts.{i}.{name}"].to(param.dtype))
        return
    if f"{prefix}experts.gate_up_proj" in tensors:
        assign(experts, "gate_up_proj", tensors[f"{prefix}experts.gate_up_proj"])
        assign(experts, "down_proj", tensors[f"{prefix}experts.down_proj"])
        return
    names = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
    layout = next((n for n in names if f"{prefix}experts.0.{n[0]}.weight" in tensors), None)
    if layout is None:
        raise KeyError(f"layer {layer}: unknown expert layout in the checkpoint under {prefix}experts")
    gate_name, up_name, down_name = layout
    per = [
        [tensors[f"{prefix}experts.{i}.{name}.weight"] for name in (gate_name, up_name, down_name)]
        for i in range(n)
    ]
    assign(experts, "gate_up_proj", torch.stack([torch.cat([g, u]) for g, u, _ in per]))
    assign(experts, "down_proj", torch.stack([d for _, _, d in per]))
