"""The coreset API (``fit`` on source models, ``anchors``, ``predict`` a new model's score), RepCore, and the
baselines that select from source models' correctness: :class:`RandomCoreset` and :class:`AnchorPoints`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_llm.evaluation.repcore.align import Alignment, ArrayLike, _as_matrix, align_representations
from lightning_llm.evaluation.repcore.clustering import cluster_anchors
from lightning_llm.evaluation.repcore.ridge import AnchorRidge

__all__ = ["AnchorPoints", "RandomCoreset", "RepCore"]


class _Coreset(ABC):
    """Shared API: ``fit`` on source models' correctness (and hidden states), then ``predict`` a new model's
    full score from its results on ``anchors`` (columns in the order of ``anchors``)."""

    def __init__(
        self,
        num_anchors: int,
        *,
        estimator: Literal["ridge", "weighted"] = "ridge",
        alpha: float | None = None,
        seed: int = 0,
    ):
        if num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
        if estimator not in ("ridge", "weighted"):
            raise ValueError(f"estimator must be 'ridge' or 'weighted', got {estimator!r}")
        self.num_anchors = num_anchors
        self.estimator = estimator
        self.alpha = alpha
        self.seed = seed
        self.anchors: Tensor | None = None
        self.weights: Tensor | None = None
        self._ridge: AnchorRidge | None = None

    def _check(self, correctness: ArrayLike, min_models: int = 2) -> Tensor:
        y = _as_matrix(torch.as_tensor(correctness).float(), "correctness")
        if y.shape[0] < min_models:
            raise ValueError(
                f"{type(self).__name__} needs at least {min_models} source models, got {y.shape[0]}"
            )
        if self.num_anchors > y.shape[1]:
            raise ValueError(f"num_anchors={self.num_anchors} exceeds the benchmark's {y.shape[1]} items")
        return y

    @abstractmethod
    def _select(
        self, correctness: Tensor, hidden_states: Sequence[ArrayLike] | None
    ) -> tuple[Tensor, Tensor]:
        """(anchor indices, anchor weights) of the method."""

    def fit(
        self,
        correctness: ArrayLike,
        hidden_states: Sequence[ArrayLike] | None = None,
        scores: ArrayLike | None = None,
    ):
        """Select anchors from source models and fit the extrapolation.

        Args:
            correctness: ``[M, N]`` 0/1 results of ``M`` source models on ``N`` items.
            hidden_states: per source model ``[N, D_m]`` (RepCore only).
            scores: ``[M]`` full-benchmark scores to extrapolate; default the mean correctness.
        """
        y = self._check(correctness)
        s = y.mean(1) if scores is None else torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
        if s.shape[0] != y.shape[0]:
            raise ValueError(f"{y.shape[0]} source models but {s.shape[0]} scores")
        self.anchors, self.weights = self._select(y, hidden_states)
        self._fit_estimator(y, s)
        return self

    def _fit_estimator(self, y: Tensor, s: Tensor) -> None:
        if self.estimator == "ridge":
            self._ridge = AnchorRidge(self.alpha).fit(y[:, self.anchors], s, self.weights)

    def predict(self, anchor_correctness: ArrayLike) -> Tensor:
        """Estimated full-benchmark scores ``[T]`` from ``[T, K]`` results on ``anchors``."""
        if self.anchors is None or self.weights is None:
            raise RuntimeError("call fit() first")
        a = _as_matrix(torch.as_tensor(anchor_correctness).float(), "anchor_correctness")
        if a.shape[1] != len(self.anchors):
            raise ValueError(f"expected results on {len(self.anchors)} anchors, got {a.shape[1]} columns")
        if self.estimator == "ridge":
            assert self._ridge is not None
            return self._ridge.predict(a)
        return a @ self.weights

    def estimate(self, correctness: ArrayLike) -> Tensor:
        """Convenience for evaluation: ``predict`` from full ``[T, N]`` correctness, reading only the anchors."""
        if self.anchors is None:
            raise RuntimeError("call fit() first")
        return self.predict(torch.as_tensor(correctness)[:, self.anchors])


class RepCore(_Coreset):
    """RepCore: anchors from k-means on the aligned (generalized-Procrustes) hidden states of source models.

    Args:
        num_anchors: coreset size :math:`K`.
        dim: shared-space dimension (per-model PCA before alignment).
        whiten: whiten each model's principal directions before aligning (generalized-CCA reading).
        estimator: ``"ridge"`` (:class:`AnchorRidge` shrunk towards the cluster weights) or ``"weighted"``
            (:math:`\\sum_c w_c a_c`, no source scores needed beyond selection).
        alpha: ridge strength; ``None`` = leave-one-out over the source models.
        seed: k-means seed; anchors are a deterministic function of inputs and seed.
    """

    def __init__(
        self,
        num_anchors: int,
        *,
        dim: int = 16,
        whiten: bool = False,
        estimator: Literal["ridge", "weighted"] = "ridge",
        alpha: float | None = None,
        seed: int = 0,
    ):
        super().__init__(num_anchors, estimator=estimator, alpha=alpha, seed=seed)
        self.dim = dim
        self.whiten = whiten
        self.alignment: Alignment | None = None

    def _select(self, correctness, hidden_states):
        if hidden_states is None:
            raise ValueError("RepCore needs the source models' hidden_states (one [N, D_m] matrix per model)")
        if len(hidden_states) != correctness.shape[0]:
            raise ValueError(f"{len(hidden_states)} hidden-state matrices for {correctness.shape[0]} models")
        for m, h in enumerate(hidden_states):
            if h.shape[0] != correctness.shape[1]:
                raise ValueError(
                    f"hidden_states[{m}] has {h.shape[0]} items, correctness has {correctness.shape[1]}"
                )
        dim = min(self.dim, min(h.shape[1] for h in hidden_states), correctness.shape[1] - 1)
        self.alignment = align_representations(hidden_states, dim, whiten=self.whiten)
        return cluster_anchors(self.alignment.consensus.numpy(), self.num_anchors, self.seed)


class RandomCoreset(_Coreset):
    """Uniformly random anchors (seeded), uniform weights: the baseline every coreset must beat."""

    def _select(self, correctness, hidden_states):
        n = correctness.shape[1]
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        anchors = perm[: self.num_anchors].sort().values
        return anchors, torch.full((self.num_anchors,), 1.0 / self.num_anchors, dtype=torch.float64)


class AnchorPoints(_Coreset):
    """Anchor points (Vivek et al., 2023): cluster items by their correctness pattern across source models.

    Each item is the vector of source models' results on it, centred and normalised per item so Euclidean
    k-means follows the correlation distance the paper clusters with (we have 0/1 correctness, not the
    per-model gold-class probabilities the paper can use); anchors are the items nearest the centroids.
    """

    def _select(self, correctness, hidden_states):
        cols = correctness.T.numpy()
        cols = cols - cols.mean(1, keepdims=True)
        norms = np.linalg.norm(cols, axis=1, keepdims=True)
        cols = np.divide(cols, norms, out=np.zeros_like(cols), where=norms > 0)
        return cluster_anchors(cols, self.num_anchors, self.seed)
