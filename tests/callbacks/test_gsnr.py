"""GSNR: the pure function by hand, the callback in a tiny Trainer run, and a resume in mid-window."""

from __future__ import annotations

import io
import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_llm.callbacks import GradientSNRMonitor, gradient_snr
from lightning_llm.callbacks.gsnr import mean_finite


def test_gradient_snr_by_hand():
    # columns: (1, 3, 2): mean 2, unbiased variance 1 -> 4; constant 2 -> inf; (1, -1, 0) -> 0; zeros -> nan
    grads = torch.tensor([[1.0, 2.0, 1.0, 0.0], [3.0, 2.0, -1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    snr = gradient_snr(grads)
    assert snr.dtype == torch.float64
    assert snr[0] == 4.0 and math.isinf(snr[1]) and snr[2] == 0.0 and math.isnan(snr[3])
    assert mean_finite(snr) == 2.0
    # any trailing shape: [S, 2, 2]
    assert gradient_snr(grads.view(3, 2, 2)).shape == (2, 2)
    with pytest.raises(ValueError, match="at least 2"):
        gradient_snr(torch.ones(1, 3))


class Regression(L.LightningModule):
    """``nn.Linear(4, 1)`` on a noisy linear target; records each step's gradients after the callbacks ran."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.grads: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + 0.3 * torch.randn(64, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def test_callback_logs_the_gsnr_of_each_window(quiet_trainer):
    module = Regression()
    monitor = GradientSNRMonitor(window=4)
    trainer = quiet_trainer(max_steps=10, callbacks=[monitor])
    trainer.fit(module, _loader())
    # two complete windows (steps 1-4, 5-8); global_step is counted after the step, so 3 and 7
    assert [step for step, _ in monitor.history] == [3, 7]
    assert monitor.count == 2  # steps 9, 10 are in the open window
    window = module.grads[4:8]
    expected_all = []
    for name in ("layer.weight", "layer.bias"):
        snr = gradient_snr(torch.stack([g[name] for g in window]))
        expected_all.append(snr.flatten())
        assert monitor.last[name] == pytest.approx(mean_finite(snr), rel=1e-9)
        assert float(trainer.callback_metrics[f"gsnr/{name}"]) == pytest.approx(mean_finite(snr), rel=1e-6)
    assert monitor.last["mean"] == pytest.approx(mean_finite(torch.cat(expected_all)), rel=1e-9)
    assert float(trainer.callback_metrics["gsnr/mean"]) == pytest.approx(monitor.last["mean"], rel=1e-6)


def test_callback_follows_only_the_named_parameters(quiet_trainer):
    monitor = GradientSNRMonitor(parameters=["bias"], window=2, log_prefix="snr")
    trainer = quiet_trainer(max_steps=2, callbacks=[monitor])
    trainer.fit(Regression(), _loader())
    assert set(monitor.last) == {"layer.bias", "mean"}
    assert "snr/layer.bias" in trainer.callback_metrics and "snr/layer.weight" not in trainer.callback_metrics
    with pytest.raises(ValueError, match="no trainable parameter"):
        GradientSNRMonitor(parameters=["nothing"]).chosen_parameters(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="window"):
        GradientSNRMonitor(window=1)


def _set_grads(module: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=g) + 0.5


def test_state_dict_round_trip_mid_window_resumes_identically():
    module = nn.Linear(3, 2)
    straight = GradientSNRMonitor(window=4)
    for step in range(4):
        _set_grads(module, step)
        result = straight.add_step(module)
    assert result is not None

    first = GradientSNRMonitor(window=4)
    for step in range(2):
        _set_grads(module, step)
        assert first.add_step(module) is None
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as in a checkpoint
    buffer.seek(0)
    resumed = GradientSNRMonitor(window=4)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.count == 2
    for step in range(2, 4):
        _set_grads(module, step)
        resumed_result = resumed.add_step(module)
    assert resumed_result == result  # bit-identical
    assert resumed.count == 0 and resumed.state_dict()["mean"] == {}
    # the online estimate equals the pure function on the stacked gradients
    stacked = []
    for step in range(4):
        _set_grads(module, step)
        stacked.append(module.weight.grad.clone())
    assert result["weight"] == pytest.approx(mean_finite(gradient_snr(torch.stack(stacked))), rel=1e-12)


def test_missing_gradient_counts_as_zero():
    module = nn.Linear(2, 1)
    monitor = GradientSNRMonitor(window=2)
    module.weight.grad = torch.tensor([[1.0, 3.0]])
    module.bias.grad = None
    monitor.add_step(module)
    module.weight.grad = torch.tensor([[3.0, 3.0]])
    module.bias.grad = torch.tensor([2.0])
    result = monitor.add_step(module)
    # weight: (1, 3) -> 4 / 2 = 2, (3, 3) -> inf (left out); bias: (0, 2) -> 1 / 2
    assert result == {"weight": 2.0, "bias": 0.5, "mean": 1.25}
