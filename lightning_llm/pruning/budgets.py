r"""How many experts each MoE layer keeps: effective ranks and a proportional split of the total.

RaGEP's step 1 (docs/methods.md §15). For a layer's calibration matrix :math:`X` with singular values
:math:`\sigma_k`,

.. math::
    p_k = \frac{\sigma_k}{\sum_j \sigma_j}, \qquad \operatorname{erank}(X) = \exp\Big(-\sum_k p_k \log p_k\Big)

(Roy & Vetterli, 2007). Of the :math:`\sum_l E_l` experts, :math:`K = \operatorname{round}(\rho \sum_l E_l)`
are kept (:math:`\rho` = ``keep_ratio``), split as :math:`b_l \propto \operatorname{erank}_l`, clipped to
:math:`[\max(1, k_{\text{top}}), E_l]` and rounded with largest remainders (:func:`layer_budgets`). Which matrix
:math:`X` is (the experts' gate-weighted outputs or the layer's input) is
:meth:`~lightning_llm.pruning.statistics.MoELayerStats.erank`'s ``source``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["check_keep_ratio", "effective_rank", "layer_budgets"]


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
    """Raise ``ValueError`` unless ``keep_ratio`` is a number in ``(0, 1]``."""
    if not isinstance(keep_ratio, (int, float)) or not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
