"""Alignment of several models' per-item representations into one shared space (RepCore's step 2): per-model
PCA and unit scaling, then a generalized Procrustes analysis to a consensus (:func:`align_representations`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["Alignment", "ArrayLike", "align_representations"]

ArrayLike = Tensor | np.ndarray


@dataclass
class Alignment:
    """Result of :func:`align_representations`.

    Attributes:
        consensus: ``[N, k]`` shared representation :math:`Z` of the items.
        projections: per model ``[D_m, k]`` linear maps :math:`W_m` (applied to centred states).
        means: per model ``[D_m]`` centring vectors.
        residuals: per model :math:`\\lVert X_m W_m - Z\\rVert_F / \\lVert Z\\rVert_F` (0 = perfect agreement).
    """

    consensus: Tensor
    projections: list[Tensor]
    means: list[Tensor]
    residuals: list[float]

    def transform(self, model: int, states: ArrayLike) -> Tensor:
        """Map ``[n, D_model]`` states of source model ``model`` into the shared space, ``[n, k]``."""
        x = torch.as_tensor(states, dtype=torch.float64)
        if x.ndim != 2 or x.shape[1] != self.projections[model].shape[0]:
            raise ValueError(
                f"model {model} has width {self.projections[model].shape[0]}, got {tuple(x.shape)}"
            )
        return (x - self.means[model]) @ self.projections[model]

    def relative_map(self, source: int, target: int) -> Tensor:
        """Least-squares linear map from model ``source``'s (centred) space to ``target``'s through the shared
        space, :math:`W_{source} W_{target}^{+}` (``[D_source, D_target]``)."""
        return self.projections[source] @ torch.linalg.pinv(self.projections[target])


def _as_matrix(x: ArrayLike, name: str) -> Tensor:
    t = torch.as_tensor(x).detach().to(torch.float64).cpu()
    if t.ndim != 2:
        raise ValueError(f"{name} must be a 2-D [items, width] matrix, got shape {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} has non-finite values")
    return t


def align_representations(
    representations: Sequence[ArrayLike],
    dim: int | None = 16,
    *,
    whiten: bool = False,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> Alignment:
    """Align per-item representations of several models (widths may differ) into one shared space.

    Generalized Procrustes analysis to a consensus after per-model PCA to ``dim`` dimensions and unit Frobenius
    scaling (every model weighs the same); the objective is in :mod:`~lightning_llm.evaluation.repcore`.
    ``whiten=True`` scales each principal direction to unit variance first (a generalized-CCA reading: only
    correlation structure is aligned, not variance). ``dim=None`` keeps ``min(D_m, N - 1)`` over models.

    Raises:
        ValueError: fewer than two models, differing item counts, or ``dim`` out of range.
    """
    if len(representations) < 2:
        raise ValueError(f"need at least two source models to align, got {len(representations)}")
    xs = [_as_matrix(x, f"representations[{m}]") for m, x in enumerate(representations)]
    n = xs[0].shape[0]
    if any(x.shape[0] != n for x in xs):
        raise ValueError(
            f"all models must represent the same items, got item counts {[x.shape[0] for x in xs]}"
        )
    if n < 3:
        raise ValueError(f"need at least 3 items, got {n}")
    max_dim = min(min(x.shape[1] for x in xs), n - 1)
    k = max_dim if dim is None else dim
    if not 1 <= k <= max_dim:
        raise ValueError(f"dim must be in [1, {max_dim}] (smallest width, items - 1), got {dim}")
    means, bases, ys = [], [], []
    for x in xs:
        mean = x.mean(0)
        u, s, vh = torch.linalg.svd(x - mean, full_matrices=False)
        # Deterministic signs (the largest-magnitude loading of each direction positive): only for
        # reproducibility, Procrustes handles any sign.
        signs = torch.sign(vh[:k].gather(1, vh[:k].abs().argmax(1, keepdim=True))).squeeze(1)
        signs[signs == 0] = 1
        basis = vh[:k].T * signs
        if whiten:
            basis = basis / s[:k].clamp_min(1e-12) * math.sqrt(n - 1)
        y = (x - mean) @ basis
        scale = y.norm().clamp_min(1e-12)
        means.append(mean)
        bases.append(basis / scale)
        ys.append(y / scale)
    rotations = [torch.eye(k, dtype=torch.float64) for _ in ys]
    z = ys[0].clone()
    previous = math.inf
    for _ in range(max_iter):
        for m, y in enumerate(ys):
            u, _, vh = torch.linalg.svd(y.T @ z)
            rotations[m] = u @ vh
        z = torch.stack([y @ r for y, r in zip(ys, rotations, strict=True)]).mean(0)
        loss = sum(float((y @ r - z).pow(2).sum()) for y, r in zip(ys, rotations, strict=True))
        if math.isfinite(previous) and previous - loss <= tol * max(previous, 1e-12):
            break
        previous = loss
    projections = [b @ r for b, r in zip(bases, rotations, strict=True)]
    znorm = float(z.norm().clamp_min(1e-12))
    residuals = [
        float(((x - mu) @ w - z).norm()) / znorm for x, mu, w in zip(xs, means, projections, strict=True)
    ]
    return Alignment(consensus=z, projections=projections, means=means, residuals=residuals)
