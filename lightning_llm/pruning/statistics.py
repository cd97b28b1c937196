"""Calibration statistics of a sparse MoE's layers, the input of every expert-selection method.

:func:`collect_moe_statistics` runs the unpruned model once over calibration batches (layer :math:`l` sees the
unpruned layers before it) and keeps, per MoE layer and on the non-padding tokens, the router logits, the
router's top-:math:`k` choice and weights and every expert's ungated output (:class:`MoELayerStats`). A shared
expert (Qwen-MoE) is not captured: it is never pruned and cancels out of every score.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_llm.backbones.moe import moe_blocks, num_experts, router_normalizes, router_top_k
from lightning_llm.pruning.budgets import effective_rank

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["MoELayerStats", "collect_moe_statistics", "route"]


@dataclass
class MoELayerStats:
    """Calibration statistics of one MoE layer (fp32, CPU).

    Attributes:
        router_logits: ``[N, E]`` router logits of the ``N`` calibration tokens.
        top_k_index: ``[N, k]`` experts the router picked.
        top_k_weights: ``[N, k]`` their gate weights (as the block applies them).
        expert_outputs: ``[E, N, H]`` every expert's (ungated) output on every token.
        normalize: whether the router renormalises its top-k probabilities.
        hidden_states: ``[N, H]`` the tokens' input to the block (``None`` if not kept).
    """

    router_logits: Tensor
    top_k_index: Tensor
    top_k_weights: Tensor
    expert_outputs: Tensor
    normalize: bool = True
    hidden_states: Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.router_logits.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.top_k_index.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.router_logits.shape[0])

    def gates(self) -> Tensor:
        """Dense ``[N, E]`` gate weights: the top-k weights at their experts, 0 elsewhere."""
        dense = torch.zeros_like(self.router_logits)
        return dense.scatter_(1, self.top_k_index, self.top_k_weights)

    def gated_outputs(self) -> Tensor:
        """``[E, N, H]``: :math:`Z_e` (row t: :math:`g_e(x_t) f_e(x_t)`)."""
        return self.gates().T.unsqueeze(-1) * self.expert_outputs

    def layer_output(self, kept: Sequence[int] | None = None) -> Tensor:
        """``[N, H]`` routed output of the layer (shared expert excluded) with only ``kept`` experts, routed as
        the pruned router routes (``None``: all experts, as captured)."""
        if kept is None:
            return torch.einsum("ne,enh->nh", self.gates(), self.expert_outputs)
        kept_t = torch.as_tensor(list(kept), dtype=torch.long)
        gates = route(self.router_logits[:, kept_t], min(self.top_k, len(kept_t)), self.normalize)
        return torch.einsum("ne,enh->nh", gates, self.expert_outputs[kept_t])

    def erank(self, source: Literal["input", "experts"] = "experts", *, center: bool = True) -> float:
        """Effective rank of this layer's ``"input"`` hidden states (centred if ``center``) or of the stacked,
        flattened gate-weighted ``"experts"`` outputs (``[E, N·H]``)."""
        if source == "input":
            if self.hidden_states is None:
                raise ValueError("these statistics were collected without hidden states")
            x = self.hidden_states
            return effective_rank(x - x.mean(0) if center else x)
        if source == "experts":
            return effective_rank(self.gated_outputs().flatten(1))
        raise ValueError(f"unknown rank source {source!r}; choose 'input' or 'experts'")


def route(logits: Tensor, top_k: int, normalize: bool) -> Tensor:
    """Dense ``[N, E]`` gate weights of a softmax top-k router over ``logits [N, E]``."""
    probs = torch.softmax(logits.float(), dim=-1)
    values, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, index, values)


@torch.no_grad()
def collect_moe_statistics(
    model: PreTrainedModel,
    batches: Iterable[Mapping[str, Tensor] | Tensor],
    *,
    max_tokens: int | None = None,
    keep_hidden_states: bool = True,
) -> dict[int, MoELayerStats]:
    """Run ``model`` (eval mode, no grad) on calibration ``batches`` and gather per-layer MoE statistics.

    Args:
        model: A Mixtral- or Qwen-MoE-style causal LM (see :func:`~lightning_llm.backbones.moe.moe_blocks`).
        batches: Dicts with ``input_ids`` (and optionally ``attention_mask``; padding tokens are skipped;
            other keys such as ``labels`` are ignored) or bare ``input_ids`` tensors.
        max_tokens: Keep at most this many (the first) non-padding tokens per layer.
        keep_hidden_states: Keep each layer's input hidden states (needed for ``rank_source="input"``).

    Every expert is evaluated densely on every token (``[E, N, H]`` per layer): size the calibration set
    accordingly. Raises ``RuntimeError`` if the captured routing differs from a softmax top-k router's (a
    router this module does not understand).
    """
    blocks = moe_blocks(model)
    captured: dict[int, list[Tensor]] = {i: [] for i in blocks}
    mask_holder: list[Tensor | None] = [None]

    def make_hook(index: int):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            flat = x.reshape(-1, x.shape[-1])
            mask = mask_holder[0]
            if mask is not None and mask.numel() == flat.shape[0]:
                flat = flat[mask.reshape(-1).bool()]
            captured[index].append(flat.detach().float().cpu())

        return hook

    handles = [block.register_forward_pre_hook(make_hook(i)) for i, block in blocks.items()]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        seen = False
        for batch in batches:
            seen = True
            if isinstance(batch, Tensor):
                input_ids, attention_mask = batch, None
            else:
                input_ids, attention_mask = batch["input_ids"], batch.get("attention_mask")
            if input_ids.ndim == 1:
                input_ids = input_ids.unsqueeze(0)
                attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
            mask_holder[0] = attention_mask
            model(
                input_ids=input_ids.to(device),
                attention_mask=None if attention_mask is None else attention_mask.to(device),
                use_cache=False,
            )
            if max_tokens is not None and all(
                sum(len(c) for c in v) >= max_tokens for v in captured.values()
            ):
                break
        if not seen:
            raise ValueError("no calibration batch")
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    stats = {}
    for index, block in blocks.items():
        x = torch.cat(captured[index])[:max_tokens]
        if len(x) == 0:
            raise ValueError("the calibration batches have no non-padding token")
        stats[index] = _layer_stats(block, x, keep_hidden_states)
    return stats


def _layer_stats(block: nn.Module, x: Tensor, keep_hidden_states: bool) -> MoELayerStats:
    param = block.gate.weight
    xd = x.to(device=param.device, dtype=param.dtype)
    logits = nn.functional.linear(xd, param, getattr(block.gate, "bias", None)).float()
    top_k, normalize = router_top_k(block), router_normalizes(block)
    out = block.gate(xd)
    if (
        isinstance(out, tuple) and len(out) == 3
    ):  # transformers 5 routers: (logits, top-k weights, top-k index)
        top_w, top_i = out[1].float(), out[2]
    else:
        gates = route(logits, top_k, normalize)
        top_w, top_i = torch.topk(gates, top_k, dim=-1)
    dense = torch.zeros_like(logits).scatter_(1, top_i, top_w)
    if not torch.allclose(dense, route(logits, top_k, normalize), atol=1e-5, rtol=1e-4):
        raise RuntimeError(
            f"the router of {type(block).__name__} is not a softmax top-{top_k} router (normalize={normalize}); "
            "its pruned routing cannot be simulated"
        )
    outputs = torch.stack([_expert_output(block.experts, e, xd) for e in range(num_experts(block))])
    return MoELayerStats(
        router_logits=logits.cpu(),
        top_k_index=top_i.cpu(),
        top_k_weights=top_w.cpu(),
        expert_outputs=outputs.float().cpu(),
        normalize=normalize,
        hidden_states=x if keep_hidden_states else None,
    )


def _expert_output(experts: nn.Module, e: int, x: Tensor) -> Tensor:
    """Expert ``e``'s ungated output on every row of ``x``, through the model's own expert code."""
    if isinstance(experts, nn.ModuleList):
        return experts[e](x)
    index = torch.full((x.shape[0], 1), e, dtype=torch.long, device=x.device)
    return experts(x, index, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))
