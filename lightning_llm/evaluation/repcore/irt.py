"""The IRT coreset baseline (tinyBenchmarks, Polo et al., 2024): a 2PL item-response model, anchors clustered in
item-parameter space, p-IRT extrapolation (:class:`IRTCoreset`)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_llm.evaluation.repcore.align import ArrayLike, _as_matrix
from lightning_llm.evaluation.repcore.clustering import cluster_anchors
from lightning_llm.evaluation.repcore.coreset import _Coreset

__all__ = ["IRTCoreset"]


class IRTCoreset(_Coreset):
    r"""tinyBenchmarks-style IRT (Polo et al., 2024) with a unidimensional 2PL model and p-IRT extrapolation.

    .. math:: P(y_{mi} = 1) = \sigma\big(a_i(\theta_m - b_i)\big)

    Item parameters come from the source models, by ``backend="torch"`` (joint MAP: Adam on the Bernoulli
    log-likelihood with priors :math:`\theta \sim \mathcal N(0,1)`, :math:`\log a \sim \mathcal N(0, 1)`,
    :math:`b \sim \mathcal N(0, 3^2)`) or ``backend="girth"`` (marginal maximum likelihood, ``girth.twopl_mml``,
    if installed). Anchors: k-means on the standardised item parameters :math:`(a_i, b_i)`. A new model's
    ability :math:`\hat\theta` is the MAP on its anchor results (grid search, exact and batched), and

    .. math:: \hat s = \frac1N\Big(\sum_{i \in \text{anchors}} y_i + \sum_{i \notin \text{anchors}}
       \sigma\big(a_i(\hat\theta - b_i)\big)\Big)

    (p-IRT). tinyBenchmarks fits a multidimensional IRT with py-irt; the 1-D 2PL is the simplest reading and
    what 10-20 source models can support. ``estimator``/``alpha`` are not used: the IRT model is the estimator.
    """

    def __init__(
        self,
        num_anchors: int,
        *,
        backend: Literal["torch", "girth"] = "torch",
        steps: int = 800,
        item_parameters: tuple[Tensor, Tensor] | None = None,
        seed: int = 0,
    ):
        super().__init__(num_anchors, seed=seed)
        if backend not in ("torch", "girth"):
            raise ValueError(f"backend must be 'torch' or 'girth', got {backend!r}")
        self.backend = backend
        self.steps = steps
        # (discrimination, difficulty) fitted before on the same source models: skips the (slow, for girth)
        # IRT fit when only the anchor count changes.
        self.item_parameters = item_parameters
        self.discrimination: Tensor | None = None
        self.difficulty: Tensor | None = None
        self._n_items = 0

    def _fit_irt(self, y: Tensor) -> tuple[Tensor, Tensor]:
        if self.backend == "girth":
            try:
                import girth
            except ImportError as err:  # pragma: no cover - depends on the environment
                raise ImportError("backend='girth' needs `pip install girth`") from err
            out = girth.twopl_mml(y.T.numpy().astype(int))
            a = torch.as_tensor(np.nan_to_num(out["Discrimination"], nan=1.0), dtype=torch.float64)
            b = torch.as_tensor(np.nan_to_num(out["Difficulty"], nan=0.0), dtype=torch.float64)
            return a.clamp(0.05, 10.0), b.clamp(-6.0, 6.0)
        m, n = y.shape
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            theta = torch.zeros(m, dtype=torch.float64, requires_grad=True)
            log_a = torch.zeros(n, dtype=torch.float64, requires_grad=True)
            b = torch.zeros(n, dtype=torch.float64, requires_grad=True)
            opt = torch.optim.Adam([theta, log_a, b], lr=0.05)
            for _ in range(self.steps):
                logits = log_a.exp() * (theta[:, None] - b[None])
                nll = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="sum")
                prior = 0.5 * (theta.pow(2).sum() + log_a.pow(2).sum() + (b / 3).pow(2).sum())
                loss = (nll + prior) / (m * n)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return log_a.detach().exp(), b.detach()

    def _select(self, correctness, hidden_states):
        if self.item_parameters is None:
            a, b = self._fit_irt(correctness)
        else:
            a, b = (torch.as_tensor(p, dtype=torch.float64).reshape(-1) for p in self.item_parameters)
            if a.shape[0] != correctness.shape[1] or b.shape[0] != correctness.shape[1]:
                raise ValueError(f"item_parameters must have {correctness.shape[1]} entries each")
        self.discrimination, self.difficulty = a, b
        self._n_items = correctness.shape[1]
        points = torch.stack([a, b], 1).numpy()
        points = (points - points.mean(0)) / points.std(0).clip(1e-12)
        return cluster_anchors(points, self.num_anchors, self.seed)

    def _fit_estimator(self, y, s):
        pass

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        if self.anchors is None or self.discrimination is None or self.difficulty is None:
            raise RuntimeError("call fit() first")
        y = _as_matrix(torch.as_tensor(anchor_correctness).float(), "anchor_correctness")
        if y.shape[1] != len(self.anchors):
            raise ValueError(f"expected results on {len(self.anchors)} anchors, got {y.shape[1]} columns")
        a, b = self.discrimination, self.difficulty
        grid = torch.linspace(-6, 6, 1201, dtype=torch.float64)
        logits = a[self.anchors][None] * (grid[:, None] - b[self.anchors][None])  # [G, K]
        loglik = (
            y @ torch.nn.functional.logsigmoid(logits).T + (1 - y) @ torch.nn.functional.logsigmoid(-logits).T
        )
        theta = grid[(loglik - 0.5 * grid.pow(2)).argmax(1)]  # [T]
        p = torch.sigmoid(a[None] * (theta[:, None] - b[None]))  # [T, N]
        mask = torch.ones(self._n_items, dtype=torch.bool)
        mask[self.anchors] = False
        return (y.sum(1) + p[:, mask].sum(1)) / self._n_items
