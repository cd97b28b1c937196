"""Forecasting metrics (OpenForecaster, arXiv 2512.25070): accuracy, Brier score, calibration error.

torchmetrics already has what they need: accuracy is a :class:`~torchmetrics.MeanMetric` of the correctness
:math:`c`, the Brier score is :class:`~torchmetrics.MeanSquaredError` of :math:`(q, c)`, and the expected
calibration error is :class:`~torchmetrics.classification.BinaryCalibrationError` of :math:`(q, c)`. What it
lacks is written here: reading ``(q, c)`` out of completions (:func:`forecast_outcomes`) and the bins of a
reliability diagram (:func:`reliability_bins`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric, MeanSquaredError, MetricCollection
from torchmetrics.classification import BinaryCalibrationError

from lightning_llm.text import normalize_answer, parse_forecast
from lightning_llm.types import Example

__all__ = ["ForecastingMetrics", "forecast_outcomes", "reliability_bins"]


def forecast_outcomes(
    completions: Sequence[str], examples: Sequence[Example]
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, c, parsed)`` per completion: stated probability, correctness (0/1), whether it parsed.

    Binary questions (``metadata["outcome"]``) count as correct when the yes/no answer matches the outcome.
    An unparsable completion has ``c = 0`` and ``q = 0`` (it committed to nothing: unverified, the paper
    reports metrics on parsed forecasts); filter on ``parsed`` to exclude it.
    """
    qs, cs, ok = [], [], []
    for completion, example in zip(completions, examples, strict=True):
        parsed = parse_forecast(completion)
        if parsed is None:
            qs.append(0.0), cs.append(0.0), ok.append(False)
            continue
        answer, q = parsed
        qs.append(q)
        cs.append(float(normalize_answer(answer) == normalize_answer(example.answer)))
        ok.append(True)
    return torch.tensor(qs), torch.tensor(cs), torch.tensor(ok, dtype=torch.bool)


class ForecastingMetrics(MetricCollection):
    """``accuracy`` (mean :math:`c`), ``brier`` (mean :math:`(q - c)^2`, lower is better) and
    ``calibration_error`` (the ``n_bins`` expected calibration error, :math:`\\sum_b \\frac{n_b}{n}|\\bar q_b -
    \\bar c_b|`) of ``update(q, c)``; ``update_from_text(completions, examples)`` parses first.

    Args:
        n_bins: Equal-width confidence bins of the calibration error.
        prefix: Prefix of the metric names (e.g. ``"val/"``).
    """

    def __init__(self, n_bins: int = 10, prefix: str | None = None, **kwargs: Any) -> None:
        if n_bins < 1:
            raise ValueError(f"n_bins must be >= 1, got {n_bins}")
        super().__init__(
            {
                "accuracy": MeanMetric(),
                "brier": MeanSquaredError(),
                "calibration_error": BinaryCalibrationError(n_bins=n_bins, norm="l1"),
            },
            prefix=prefix,
            compute_groups=False,
            **kwargs,
        )

    def update(self, q: Tensor, c: Tensor) -> None:  # type: ignore[override]
        q, c = q.float().flatten(), c.float().flatten()
        for name, metric in self.items(keep_base=True):
            if name == "accuracy":
                metric.update(c)
            elif name == "brier":
                metric.update(q, c)
            else:
                metric.update(q, c.long())

    def update_from_text(self, completions: Sequence[str], examples: Sequence[Example]) -> None:
        q, c, _ = forecast_outcomes(completions, examples)
        self.update(q, c)


def reliability_bins(q: Tensor, c: Tensor, n_bins: int = 10) -> tuple[Tensor, Tensor, Tensor]:
    """A reliability diagram's bins: ``(mean confidence, accuracy, count)`` per equal-width bin of ``q``.

    Bins are ``[0, 1/n), …, [(n-1)/n, 1]``; an empty bin has confidence and accuracy NaN.
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    q, c = q.float().flatten(), c.float().flatten()
    index = (q * n_bins).long().clamp(0, n_bins - 1)
    count = torch.bincount(index, minlength=n_bins).float()
    conf = torch.zeros(n_bins).index_add_(0, index, q) / count
    acc = torch.zeros(n_bins).index_add_(0, index, c) / count
    return conf, acc, count.long()
