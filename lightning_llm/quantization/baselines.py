"""Peer baseline: bitsandbytes NF4 (4-bit NormalFloat, blockwise absmax) on every ``nn.Linear`` of a model.

For side-by-side comparisons in the tutorial, the behaviour test and ``benchmarks/quant.py``; ``bitsandbytes``
is imported only when called. The layers become ``bnb.nn.Linear4bit`` (block size 64, fp32 compute), which
run on CPU and GPU alike.

bitsandbytes 0.50's CPU kernels (dequantise and the packed matmul) index the absmax blocks per row: with an
input width that is not a multiple of the block size they apply the wrong scales (measured on a 128 × 352
N(0, 1) matrix: relative error 0.060 after a quantise-dequantise round trip vs 0.008 for 352 × 128, and 0.137
on the tiny model's ``down_proj``). Such layers are therefore zero-padded to the next multiple of 64 input
columns (the activations are padded to match), which leaves the NF4 blocks of every row intact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import _set_module
from .model import _skipped

__all__ = ["quantize_model_nf4"]

_NF4_BLOCK = 64  # bitsandbytes' default 4-bit block size


class _PaddedInput(nn.Module):
    """Zero-pads the last dimension of the input by ``pad`` before ``inner``."""

    def __init__(self, inner: nn.Module, pad: int) -> None:
        super().__init__()
        self.inner, self.pad = inner, pad

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(F.pad(x, (0, self.pad)))


def quantize_model_nf4(
    model: nn.Module,
    skip=("lm_head",),
    compute_dtype: torch.dtype = torch.float32,
    cpu_bf16_kernel: bool = False,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place, names in ``skip`` excepted) by an NF4 ``Linear4bit``.

    ``cpu_bf16_kernel``: allow bitsandbytes' packed AVX512-bf16 CPU kernel in eval mode (its fastest CPU path,
    for timing). It computes in bf16, which adds activation rounding to the 4-bit weight error, so the default
    (False) keeps bitsandbytes' fp32 dequantise-and-matmul path: a quality comparison of the weights alone.
    """
    import bitsandbytes as bnb

    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not _skipped(name, skip)
    ]
    for name, mod in targets:
        device = mod.weight.device
        pad = (-mod.in_features) % _NF4_BLOCK
        q = bnb.nn.Linear4bit(
            mod.in_features + pad,
            mod.out_features,
            bias=mod.bias is not None,
            compute_dtype=compute_dtype,
            quant_type="nf4",
        )
        weight = F.pad(mod.weight.data.detach(), (0, pad))
        q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
        if mod.bias is not None:
            q.bias = nn.Parameter(mod.bias.detach().clone(), requires_grad=False)
        q.support_avx512bf16_for_cpu = bool(
            getattr(q, "support_avx512bf16_for_cpu", False) and cpu_bf16_kernel
        )
        q = q.to(device)
        _set_module(model, name, _PaddedInput(q, pad) if pad else q)
    return model
