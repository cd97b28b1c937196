r"""RaGEP, rank-aware geometric expert pruning (docs/methods.md §15): greedy spectral salience within a layer.

RaGEP has no public code; this is *our reading* of it, with every unverified choice a parameter. It has two
steps: the budget of each layer is proportional to the layer's effective rank
(:mod:`lightning_llm.pruning.budgets`), and within a layer the experts are kept greedily by spectral salience
(:class:`RaGEPSelection`, below).

With :math:`Z_e \in \mathbb R^{N\times H}` expert :math:`e`'s gate-weighted outputs on the :math:`N` calibration
tokens (row :math:`t`: :math:`g_e(x_t)\, f_e(x_t)`, zero where the router did not pick :math:`e`),
:math:`C_e = Z_e^\top Z_e` and :math:`S` the experts kept so far, let :math:`V_S` hold the top eigenvectors of
:math:`\sum_{s\in S} C_s` that carry a fraction ``subspace_energy`` of its trace (the top singular directions of
the kept experts' stacked outputs). Then

.. math::
    \text{energy}_e = \operatorname{tr} C_e, \qquad
    \text{residual}_e = \operatorname{tr} C_e - \operatorname{tr}(V_S^\top C_e V_S), \qquad
    \text{score}_e = \text{energy}_e^{\,1-\alpha}\,\text{residual}_e^{\,\alpha},

and the expert with the largest score joins :math:`S`, until the layer's budget is reached (:math:`\alpha` =
``alpha``; 1 is the pure residual energy). A duplicate of a kept expert has (almost) no residual energy, so
an expert writing into new directions wins over it even with less energy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_llm.pruning.base import ExpertSelection, check_budget
from lightning_llm.pruning.statistics import MoELayerStats

__all__ = ["RaGEPSelection", "ragep_select"]


class RaGEPSelection(ExpertSelection):
    """RaGEP's greedy spectral-salience selection (module docstring); options as in :func:`ragep_select`."""

    name = "ragep"

    def __init__(
        self,
        *,
        alpha: float = 1.0,
        subspace_energy: float = 0.9,
        max_rank: int | None = None,
        gate_weighted: bool = True,
    ) -> None:
        _check_options(alpha, subspace_energy)
        self.alpha = alpha
        self.subspace_energy = subspace_energy
        self.max_rank = max_rank
        self.gate_weighted = gate_weighted

    def choose(self, stats: MoELayerStats, budget: int) -> list[int]:
        return ragep_select(
            stats,
            budget,
            alpha=self.alpha,
            subspace_energy=self.subspace_energy,
            max_rank=self.max_rank,
            gate_weighted=self.gate_weighted,
        )


def ragep_select(
    stats: MoELayerStats,
    budget: int,
    *,
    alpha: float = 1.0,
    subspace_energy: float = 0.9,
    max_rank: int | None = None,
    gate_weighted: bool = True,
) -> list[int]:
    """RaGEP's greedy spectral-salience selection (module docstring): ``budget`` expert indices, in the order
    they were picked.

    Args:
        stats: The layer's calibration statistics.
        budget: Experts to keep.
        alpha: Exponent of the residual energy in the score (1: residual only; 0: energy only).
        subspace_energy: Fraction of the kept experts' output energy their subspace :math:`V_S` captures.
        max_rank: Cap on the dimension of :math:`V_S`.
        gate_weighted: Use gate-weighted outputs :math:`Z_e` (else the ungated outputs on all tokens).
    """
    _check_options(alpha, subspace_energy)
    check_budget(budget, stats.num_experts)
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


def _check_options(alpha: float, subspace_energy: float) -> None:
    if not 0.0 < subspace_energy <= 1.0:
        raise ValueError(f"subspace_energy must be in (0, 1], got {subspace_energy}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


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
