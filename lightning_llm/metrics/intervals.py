"""Confidence intervals for the proportions the studies report (accuracies over a fixed set of items)."""

from __future__ import annotations

import math

__all__ = ["wilson_interval"]


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``successes / n`` (95% by default)."""
    if n <= 0:
        raise ValueError("wilson_interval needs n >= 1")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
