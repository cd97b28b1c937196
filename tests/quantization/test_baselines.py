"""The bitsandbytes NF4 baseline: widths that are not multiples of the 64-weight block stay accurate (padded)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_llm.quantization import quantize_model_nf4


def test_nf4_layers_match_their_weights_for_any_width():
    """bitsandbytes 0.50's CPU kernels mis-scale input widths that are not multiples of 64 (0.06-0.14 relative
    error); the helper pads those, so every layer's relative error is NF4's usual ~0.01 on Gaussian weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(352, 128, bias=False), nn.Linear(128, 352, bias=True), nn.Linear(100, 7))
    reference = [layer.weight.detach().clone() for layer in model]
    biases = [None if layer.bias is None else layer.bias.detach().clone() for layer in model]
    quantize_model_nf4(model, skip=())
    with torch.no_grad():
        for layer, w, b in zip(model, reference, biases, strict=True):
            x = torch.randn(9, w.shape[1])
            exact = x @ w.t() + (0 if b is None else b)
            rel = float((layer.eval()(x) - exact).pow(2).mean() / exact.pow(2).mean())
            assert rel < 0.02, (tuple(w.shape), rel)
