"""Extrapolation from anchor results to the full-benchmark score: ridge regression shrunk towards the anchors'
prior weights (:class:`AnchorRidge`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_llm.evaluation.repcore.align import ArrayLike, _as_matrix

__all__ = ["AnchorRidge"]


class AnchorRidge:
    r"""Ridge regression from anchor correctness to full-benchmark score, shrunk towards prior weights.

    .. math::
        \min_{c,\beta} \sum_m (s_m - c - a_m^\top \beta)^2 + \alpha \lVert \beta - w \rVert^2

    (intercept unpenalised). ``alpha=None`` picks :math:`\alpha` by leave-one-out error over the source models
    from ``alphas``; ``alpha=0`` is least squares (minimum-norm deviation from :math:`w`), exact on a noiseless
    linear population with more source models than anchors; ``alpha=inf`` keeps :math:`\beta = w`.
    """

    def __init__(
        self, alpha: float | None = None, alphas: Sequence[float] = tuple(10.0 ** np.arange(-2, 4.5, 0.5))
    ):
        if alpha is not None and alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha
        self.alphas = (*(float(a) for a in alphas), math.inf)
        self.coef_: Tensor | None = None
        self.intercept_: float = 0.0
        self.alpha_: float | None = None

    @staticmethod
    def _solve(a: Tensor, s: Tensor, prior: Tensor, alpha: float) -> Tensor:
        """The coefficients; the intercept is then ``mean(s) - mean(a) @ beta``."""
        r = s - a @ prior
        a_mean, r_mean = a.mean(0), r.mean()
        ac, rc = a - a_mean, r - r_mean
        if math.isinf(alpha):
            delta = torch.zeros_like(prior)
        elif alpha == 0:
            delta = torch.linalg.lstsq(ac, rc.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        else:
            eye = torch.eye(a.shape[1], dtype=a.dtype)
            delta = torch.linalg.solve(ac.T @ ac + alpha * eye, ac.T @ rc)
        return prior + delta

    def fit(
        self, anchor_correctness: ArrayLike, scores: ArrayLike, prior: ArrayLike | None = None
    ) -> AnchorRidge:
        """Fit on source models: ``anchor_correctness [M, K]``, ``scores [M]``, ``prior`` weights ``[K]``
        (default uniform :math:`1/K`)."""
        a = _as_matrix(anchor_correctness, "anchor_correctness")
        s = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
        if s.shape[0] != a.shape[0]:
            raise ValueError(f"{a.shape[0]} rows of anchor correctness but {s.shape[0]} scores")
        if a.shape[0] < 2:
            raise ValueError("need at least two source models to fit the extrapolation")
        w = (
            torch.full((a.shape[1],), 1.0 / a.shape[1], dtype=torch.float64)
            if prior is None
            else (torch.as_tensor(prior, dtype=torch.float64).reshape(-1))
        )
        if w.shape[0] != a.shape[1]:
            raise ValueError(f"prior has {w.shape[0]} weights for {a.shape[1]} anchors")
        alpha = self.alpha if self.alpha is not None else self._loo_alpha(a, s, w)
        beta = self._solve(a, s, w, alpha)
        self.coef_, self.alpha_ = beta, alpha
        self.intercept_ = float(s.mean() - a.mean(0) @ beta)
        return self

    def _loo_alpha(self, a: Tensor, s: Tensor, w: Tensor) -> float:
        if a.shape[0] < 3:
            return math.inf
        best, best_err = math.inf, math.inf
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        # Largest alpha first, ties kept: prefer the stronger prior when the data cannot tell them apart.
        for alpha in sorted(self.alphas, reverse=True):
            err = 0.0
            for j in range(a.shape[0]):
                keep[:] = True
                keep[j] = False
                beta = self._solve(a[keep], s[keep], w, alpha)
                c = s[keep].mean() - a[keep].mean(0) @ beta
                err += float((c + a[j] @ beta - s[j]) ** 2)
            if err < best_err - 1e-12:
                best, best_err = alpha, err
        return best

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        """Estimated full-benchmark scores ``[T]`` from ``[T, K]`` anchor results."""
        if self.coef_ is None:
            raise RuntimeError("call fit() first")
        a = _as_matrix(anchor_correctness, "anchor_correctness")
        if a.shape[1] != self.coef_.shape[0]:
            raise ValueError(f"expected {self.coef_.shape[0]} anchor columns, got {a.shape[1]}")
        return self.intercept_ + a @ self.coef_
