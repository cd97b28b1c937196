"""How well estimated benchmark scores rank models: :func:`spearman`."""

from __future__ import annotations

import math

import numpy as np
import torch

from lightning_llm.evaluation.repcore.align import ArrayLike

__all__ = ["spearman"]


def spearman(x: ArrayLike, y: ArrayLike) -> float:
    """Spearman rank correlation of two 1-D sequences (average ranks for ties; NaN if one is constant)."""
    a = np.asarray(torch.as_tensor(x, dtype=torch.float64))
    b = np.asarray(torch.as_tensor(y, dtype=torch.float64))
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"need two 1-D sequences of equal length >= 2, got {a.shape} and {b.shape}")

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):  # average ranks over ties
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a) - (len(a) - 1) / 2, ranks(b) - (len(b) - 1) / 2
    denom = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return float((ra * rb).sum() / denom) if denom > 0 else math.nan
