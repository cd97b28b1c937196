r"""Expert pruning for sparse mixture-of-experts LMs: RaGEP and three baselines.

RaGEP (rank-aware geometric expert pruning, docs/methods.md §15) has no public code; this module is *our reading* of
it, with every unverified choice a parameter:

**1. Budget per layer from the effective rank.** For a layer's calibration matrix :math:`X` (``rank_source``:
``"experts"``, the :math:`E` rows of the experts' flattened gate-weighted outputs :math:`Z_e` below, so the
erank counts the experts the layer effectively has; or ``"input"``, the tokens' hidden states entering the MoE
block, centred) with singular values :math:`\sigma_k`,

.. math::
    p_k = \frac{\sigma_k}{\sum_j \sigma_j}, \qquad \operatorname{erank}(X) = \exp\Big(-\sum_k p_k \log p_k\Big)

(Roy & Vetterli, 2007). Of the :math:`\sum_l E_l` experts, :math:`K = \operatorname{round}(\rho \sum_l E_l)`
are kept (:math:`\rho` = ``keep_ratio``), split as :math:`b_l \propto \operatorname{erank}_l`, clipped to
:math:`[\max(1, k_{\text{top}}), E_l]` and rounded with largest remainders (:func:`layer_budgets`).

**2. Greedy spectral salience within a layer.** With :math:`Z_e \in \mathbb R^{N\times H}` expert :math:`e`'s
gate-weighted outputs on the :math:`N` calibration tokens (row :math:`t`: :math:`g_e(x_t)\, f_e(x_t)`, zero
where the router did not pick :math:`e`), :math:`C_e = Z_e^\top Z_e` and :math:`S` the experts kept so far,
let :math:`V_S` hold the top eigenvectors of :math:`\sum_{s\in S} C_s` that carry a fraction
``subspace_energy`` of its trace (the top singular directions of the kept experts' stacked outputs). Then

.. math::
    \text{energy}_e = \operatorname{tr} C_e, \qquad
    \text{residual}_e = \operatorname{tr} C_e - \operatorname{tr}(V_S^\top C_e V_S), \qquad
    \text{score}_e = \text{energy}_e^{\,1-\alpha}\,\text{residual}_e^{\,\alpha},

and the expert with the largest score joins :math:`S`, until the layer's budget is reached (:math:`\alpha` =
``alpha``; 1 is the pure residual energy). A duplicate of a kept expert has (almost) no residual energy, so
an expert writing into new directions wins over it even with less energy.

Baselines (same calibration statistics):

- ``"frequency"``: how often the router puts the expert in its top-:math:`k`.
- ``"reap"`` (Lasby et al., 2025): :math:`\frac{1}{|X_e|}\sum_{x\in X_e} g_e(x)\,\lVert f_e(x)\rVert_2` over
  the tokens :math:`X_e` routed to :math:`e`.
- ``"naee"`` (Lu et al., 2024): the subset :math:`S` minimising the layer's output reconstruction error
  :math:`\frac1N\sum_t \lVert \sum_e g_e(x_t) f_e(x_t) - \sum_{e\in S} g^S_e(x_t) f_e(x_t)\rVert^2`, where
  :math:`g^S` is the routing of the *pruned* router (softmax over the kept experts' logits, top-:math:`k`,
  renormalised when the router renormalises); exhaustive when :math:`\binom{E}{b}` is at most
  ``max_subsets``, otherwise greedy backward elimination.

Statistics are collected in one pass of the unpruned model (layer :math:`l` sees the unpruned layers before
it), on the non-padding tokens. A shared expert (Qwen-MoE) is never pruned and cancels out of every score.

Structure (:func:`prune_experts`, on :mod:`lightning_llm.backbones.moe`): pruning slices every parameter of ``experts`` and ``gate`` whose first dimension is :math:`E`, updates the modules'
``num_experts`` and the config (``num_local_experts`` / ``num_experts``), and caps the router ``top_k`` at
the smallest layer's count. HF configs hold *one* expert count, so a model whose layers keep different counts
cannot be rebuilt by a plain ``from_pretrained``: :func:`prune_experts` then records the kept experts in
``config.expert_pruning`` and ``load_backbone`` reloads it (:func:`lightning_llm.backbones.moe.load_moe`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_llm.backbones.moe import (
    moe_blocks,
    num_experts,
    router_normalizes,
    router_top_k,
    set_router_top_k,
    slice_experts,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "METHODS",
    "MoELayerStats",
    "check_keep_ratio",
    "collect_moe_statistics",
    "effective_rank",
    "layer_budgets",
    "naee_reconstruction_error",
    "prune_experts",
    "ragep_select",
    "route",
    "select_experts",
]

METHODS = ("ragep", "frequency", "reap", "naee")
Method = Literal["ragep", "frequency", "reap", "naee"]
_CONFIG_COUNT_KEYS = ("num_local_experts", "num_experts")


# ---------------------------------------------------------------------------------------------- statistics


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
        model: A Mixtral- or Qwen-MoE-style causal LM (see :func:`moe_blocks`).
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


# ----------------------------------------------------------------------------------------------- budgets


def effective_rank(x: Tensor) -> float:
    r"""Effective rank :math:`\exp(-\sum_k p_k \log p_k)`, :math:`p_k = \sigma_k / \sum_j \sigma_j`.

    ``x`` is a matrix (its singular values are used) or a 1-D tensor of singular values (non-negative).
    Zero singular values contribute nothing. Raises ``ValueError`` for an all-zero spectrum.
    """
    if x.ndim == 1:
        sigma = x.double()
        if (sigma < 0).any():
            raise ValueError("singular values must be non-negative")
    elif x.ndim == 2:
        sigma = torch.linalg.svdvals(x.double())
    else:
        raise ValueError(f"expected a matrix or a vector of singular values, got shape {tuple(x.shape)}")
    total = sigma.sum()
    if not total > 0:
        raise ValueError("the effective rank of an all-zero matrix is undefined")
    p = sigma[sigma > 0] / total
    return float(torch.exp(-(p * p.log()).sum()))


def layer_budgets(
    scores: Mapping[int, float],
    num_experts: Mapping[int, int],
    keep_ratio: float,
    *,
    min_experts: int | Mapping[int, int] = 1,
) -> dict[int, int]:
    r"""Experts to keep per layer: :math:`K = \operatorname{round}(\rho \sum_l E_l)` split :math:`\propto`
    ``scores`` (e.g. effective ranks), each clipped to ``[min_experts, E_l]``, integers by largest remainders.

    The continuous shares are :math:`q_l = \operatorname{clip}(\lambda s_l, m_l, E_l)` with :math:`\lambda`
    chosen so that :math:`\sum_l q_l = K` (water-filling: what a clipped layer cannot take goes to the others);
    then every layer gets :math:`\lfloor q_l \rfloor` and the remaining units go to the largest fractional
    parts (ties: lower layer index). :math:`K` is at least :math:`\sum_l m_l`. Equal scores give as uniform a
    split as the total allows. The result sums to :math:`K` exactly.
    """
    check_keep_ratio(keep_ratio)
    layers = sorted(num_experts)
    if not layers or sorted(scores) != layers:
        raise ValueError(
            f"scores and num_experts must cover the same non-empty layers: {sorted(scores)} vs {layers}"
        )
    upper = {i: int(num_experts[i]) for i in layers}
    lower = {i: int(min_experts if isinstance(min_experts, int) else min_experts[i]) for i in layers}
    for i in layers:
        lower[i] = min(max(lower[i], 1), upper[i])
        if not math.isfinite(scores[i]) or scores[i] < 0:
            raise ValueError(f"layer {i}: score must be finite and >= 0, got {scores[i]}")
    total_experts = sum(upper.values())
    total = max(math.floor(keep_ratio * total_experts + 0.5), sum(lower.values()))
    weights = {i: float(scores[i]) for i in layers}
    if sum(weights.values()) <= 0:
        weights = dict.fromkeys(layers, 1.0)

    def shares(lam: float) -> dict[int, float]:
        return {i: min(max(lam * weights[i], lower[i]), upper[i]) for i in layers}

    lo, hi = 0.0, 1.0
    while sum(shares(hi).values()) < total and hi < 1e30:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(shares(mid).values()) < total else (lo, mid)
    quota = shares(hi)
    budget = {i: min(max(math.floor(quota[i] + 1e-9), lower[i]), upper[i]) for i in layers}
    remainder = total - sum(budget.values())
    order = sorted(layers, key=lambda i: (-(quota[i] - budget[i]), i))
    while remainder != 0:  # normally one pass; the loop also absorbs floating-point slack
        step = 1 if remainder > 0 else -1
        changed = False
        for i in order if step > 0 else reversed(order):
            if remainder == 0:
                break
            if lower[i] <= budget[i] + step <= upper[i]:
                budget[i] += step
                remainder -= step
                changed = True
        if not changed:
            raise AssertionError("unreachable: budget bounds cannot hold the total")
    return budget


def check_keep_ratio(keep_ratio: float) -> None:
    if not isinstance(keep_ratio, (int, float)) or not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")


# --------------------------------------------------------------------------------------------- selection


def ragep_select(
    stats: MoELayerStats,
    budget: int,
    *,
    alpha: float = 1.0,
    subspace_energy: float = 0.9,
    max_rank: int | None = None,
    gate_weighted: bool = True,
) -> list[int]:
    """RaGEP's greedy spectral-salience selection (module docstring, step 2): ``budget`` expert indices, in
    the order they were picked.

    Args:
        stats: The layer's calibration statistics.
        budget: Experts to keep.
        alpha: Exponent of the residual energy in the score (1: residual only; 0: energy only).
        subspace_energy: Fraction of the kept experts' output energy their subspace :math:`V_S` captures.
        max_rank: Cap on the dimension of :math:`V_S`.
        gate_weighted: Use gate-weighted outputs :math:`Z_e` (else the ungated outputs on all tokens).
    """
    if not 0.0 < subspace_energy <= 1.0:
        raise ValueError(f"subspace_energy must be in (0, 1], got {subspace_energy}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _check_budget(budget, stats.num_experts)
    z = (stats.gated_outputs() if gate_weighted else stats.expert_outputs).double()
    grams = torch.einsum("enh,eng->ehg", z, z)  # C_e = Z_e^T Z_e
    energy = grams.diagonal(dim1=1, dim2=2).sum(-1)
    kept: list[int] = []
    kept_gram = torch.zeros_like(grams[0])
    while len(kept) < budget:
        if kept:
            basis = _top_subspace(kept_gram, subspace_energy, max_rank)
            captured = torch.einsum("hr,ehg,gr->e", basis, grams, basis)
            residual = (energy - captured).clamp(min=0)
        else:
            residual = energy
        score = energy.pow(1 - alpha) * residual.pow(alpha)
        score[kept] = -1.0
        best = int(torch.argmax(score))  # ties: lowest index
        kept.append(best)
        kept_gram += grams[best]
    return kept


def _top_subspace(gram: Tensor, energy: float, max_rank: int | None) -> Tensor:
    """Orthonormal ``[H, r]`` top eigenvectors of a PSD matrix carrying ``energy`` of its trace."""
    values, vectors = torch.linalg.eigh(gram)
    values, vectors = values.flip(0).clamp(min=0), vectors.flip(1)
    total = values.sum()
    if total <= 0:
        return vectors[:, :0]
    cumulative = values.cumsum(0) / total
    rank = int((cumulative < energy - 1e-12).sum()) + 1
    if max_rank is not None:
        rank = min(rank, max_rank)
    return vectors[:, :rank]


def naee_reconstruction_error(stats: MoELayerStats, kept: Sequence[int]) -> float:
    """Mean squared norm of the layer's output change on the calibration tokens when only ``kept`` remain."""
    diff = stats.layer_output() - stats.layer_output(kept)
    return float(diff.double().square().sum(-1).mean())


def _naee_select(stats: MoELayerStats, budget: int, max_subsets: int) -> list[int]:
    experts = list(range(stats.num_experts))
    if math.comb(len(experts), budget) <= max_subsets:
        best = min(itertools.combinations(experts, budget), key=lambda s: naee_reconstruction_error(stats, s))
        return list(best)
    kept = experts
    while len(kept) > budget:  # greedy backward elimination
        kept = min(
            ([e for e in kept if e != drop] for drop in kept),
            key=lambda s: naee_reconstruction_error(stats, s),
        )
    return kept


def _check_budget(budget: int, num_experts: int) -> None:
    if not 1 <= budget <= num_experts:
        raise ValueError(f"budget must be in [1, {num_experts}], got {budget}")


def select_experts(
    method: Method,
    stats: MoELayerStats,
    budget: int,
    *,
    max_subsets: int = 5000,
    **ragep_kwargs: Any,
) -> list[int]:
    """Indices (sorted) of the ``budget`` experts of one layer that ``method`` keeps.

    Args:
        method: ``"ragep"``, ``"frequency"``, ``"reap"`` or ``"naee"`` (module docstring).
        stats: The layer's calibration statistics.
        budget: Experts to keep, ``1 <= budget <= E``.
        max_subsets: NAEE searches exhaustively up to this many subsets, greedily beyond.
        **ragep_kwargs: Options of :func:`ragep_select`.

    Ties (frequency, REAP) go to the lower index.
    """
    _check_budget(budget, stats.num_experts)
    if ragep_kwargs and method != "ragep":
        raise ValueError(f"options {sorted(ragep_kwargs)} only apply to method='ragep'")
    if method == "ragep":
        return sorted(ragep_select(stats, budget, **ragep_kwargs))
    if method == "naee":
        return sorted(_naee_select(stats, budget, max_subsets))
    if method == "frequency":
        score = torch.bincount(stats.top_k_index.flatten(), minlength=stats.num_experts).double()
    elif method == "reap":
        gates = stats.gates().double()  # [N, E]
        norms = stats.expert_outputs.double().norm(dim=-1).T  # [N, E]
        routed = (gates > 0).sum(0).clamp(min=1)
        score = (gates * norms).sum(0) / routed
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    order = sorted(range(stats.num_experts), key=lambda e: (-float(score[e]), e))
    return sorted(order[:budget])


# ------------------------------------------------------------------------------------------------ pruning


@torch.no_grad()
def prune_experts(model: PreTrainedModel, keep: Mapping[int, Sequence[int]]) -> PreTrainedModel:
    """Remove every expert of the MoE layers in ``keep`` not listed there, in place; returns ``model``.

    ``keep`` maps a layer index (as in :func:`moe_blocks`) to the expert indices to keep (in their original
    order); layers not in ``keep`` are left whole. Every parameter of the layer's ``experts`` and ``gate`` whose
    first dimension is the expert count is sliced (expert weights and the router rows together), the modules'
    ``num_experts`` are updated and so is the config (``num_local_experts`` / ``num_experts``: the common count,
    or the largest one when layers differ). The router top-k of every layer becomes
    ``min(top_k, fewest experts in a layer)`` (the config has one ``num_experts_per_tok``). The kept original
    indices are recorded in ``config.expert_pruning["kept"]`` (cumulative over repeated pruning).
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
