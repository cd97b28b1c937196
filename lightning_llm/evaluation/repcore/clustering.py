"""Anchor selection by k-means (:func:`cluster_anchors`): each cluster's anchor is its item nearest the centroid,
weighted by the cluster's share of the items."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["cluster_anchors"]


def _kmeans(points: np.ndarray, k: int, seed: int, n_init: int = 8, iters: int = 100) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; returns labels of the best of ``n_init`` runs (lowest inertia)."""
    rng = np.random.default_rng(seed)
    n = len(points)
    best_labels, best_inertia = None, math.inf
    for _ in range(n_init):
        centers = [points[rng.integers(n)]]
        d2 = ((points - centers[0]) ** 2).sum(1)
        for _ in range(1, k):
            total = d2.sum()
            idx = rng.choice(n, p=d2 / total) if total > 0 else rng.integers(n)
            centers.append(points[idx])
            d2 = np.minimum(d2, ((points - points[idx]) ** 2).sum(1))
        c = np.stack(centers)
        labels = np.zeros(n, dtype=np.int64)
        for it in range(iters):
            dist = ((points[:, None, :] - c[None]) ** 2).sum(-1)
            new = dist.argmin(1)
            for j in range(k):  # an empty cluster takes the point farthest from its centre
                if not (new == j).any():
                    far = dist[np.arange(n), new].argmax()
                    new[far] = j
                    dist[far] = 0.0
            if it and (new == labels).all():
                break
            labels = new
            c = np.stack([points[labels == j].mean(0) for j in range(k)])
        inertia = float(((points - c[labels]) ** 2).sum())
        if inertia < best_inertia - 1e-12:
            best_labels, best_inertia = labels.copy(), inertia
    assert best_labels is not None
    return best_labels


def cluster_anchors(points: np.ndarray, k: int, seed: int) -> tuple[Tensor, Tensor]:
    """Anchors (item nearest each k-means centroid) and weights (cluster share), in ascending item order."""
    labels = _kmeans(points, k, seed)
    anchors, weights = [], []
    for j in range(k):
        members = np.flatnonzero(labels == j)
        centre = points[members].mean(0)
        anchors.append(int(members[((points[members] - centre) ** 2).sum(1).argmin()]))
        weights.append(len(members) / len(points))
    order = np.argsort(anchors)
    return (
        torch.tensor(np.asarray(anchors)[order], dtype=torch.long),
        torch.tensor(np.asarray(weights)[order], dtype=torch.float64),
    )
