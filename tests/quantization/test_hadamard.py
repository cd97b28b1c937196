"""Random Hadamard incoherence processing of a matrix: round trip, norm, outliers spread."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.kernels.hadamard import RandomHadamard
from lightning_llm.quantization import incoherence_process, incoherence_unprocess


def test_matrix_round_trip_and_incoherence():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(48, 100, generator=g)
    W[3, 7] = 50.0  # an outlier is spread over the whole matrix
    Wt = incoherence_process(W, 4, 5)
    torch.testing.assert_close(incoherence_unprocess(Wt, 4, 5), W, atol=1e-4, rtol=0)
    torch.testing.assert_close(Wt.norm(), W.norm(), atol=1e-3, rtol=1e-5)
    assert Wt.abs().max() < 0.3 * W.abs().max()
    with pytest.raises(ValueError, match="last dimension"):
        RandomHadamard(10)(torch.randn(2, 9))
