import math

import pytest
import torch

from lightning_llm.datamodules.tasks import Example
from lightning_llm.metrics import ForecastingMetrics, forecast_outcomes, reliability_bins


def test_metrics_match_hand_computation():
    q = torch.tensor([0.9, 0.2, 0.6, 0.1])
    c = torch.tensor([1, 0, 0, 1])
    metrics = ForecastingMetrics(n_bins=2)
    metrics.update(q[:2], c[:2])
    metrics.update(q[2:], c[2:])
    out = metrics.compute()
    assert out["accuracy"].item() == pytest.approx(0.5)
    assert out["brier"].item() == pytest.approx((0.01 + 0.04 + 0.36 + 0.81) / 4)
    # bins [0, .5): q .2, .1 (acc .5) -> |.15 - .5|; [.5, 1]: q .9, .6 (acc .5) -> |.75 - .5|; each half the data
    assert out["calibration_error"].item() == pytest.approx(0.5 * 0.35 + 0.5 * 0.25)
    assert set(ForecastingMetrics(prefix="val/").keys()) == {
        "val/accuracy",
        "val/brier",
        "val/calibration_error",
    }


def test_forecast_outcomes_parse_text():
    examples = [Example("", "", "Tamur"), Example("", "", "Tamur"), Example("", "", "no", {"outcome": 0})]
    texts = [
        "<answer>tamur</answer><probability>0.8</probability>",
        "garbage",
        "<answer>No</answer><probability>0.6</probability>",
    ]
    q, c, parsed = forecast_outcomes(texts, examples)
    assert q.tolist() == pytest.approx([0.8, 0.0, 0.6])
    assert c.tolist() == [1.0, 0.0, 1.0]
    assert parsed.tolist() == [True, False, True]
    metrics = ForecastingMetrics()
    metrics.update_from_text(texts, examples)
    assert metrics.compute()["accuracy"].item() == pytest.approx(2 / 3)


def test_reliability_bins():
    conf, acc, count = reliability_bins(torch.tensor([0.05, 0.15, 0.95, 1.0]), torch.tensor([0, 1, 1, 0]), 10)
    assert count.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 2]
    assert conf[0].item() == pytest.approx(0.05) and acc[1].item() == 1.0 and acc[9].item() == 0.5
    assert math.isnan(conf[5].item())
    with pytest.raises(ValueError):
        reliability_bins(torch.zeros(1), torch.zeros(1), 0)
