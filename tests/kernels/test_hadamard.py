"""Random Hadamard rotations: exact orthogonality, invertibility, seeding, the fast path."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.kernels.hadamard import RandomHadamard, fwht


@pytest.mark.parametrize("n", [1, 7, 12, 20, 64, 96, 100, 128, 12 * 8, 172, 256])
def test_orthogonal_and_invertible(n):
    rh = RandomHadamard(n, seed=3)
    Q = rh.matrix()
    torch.testing.assert_close(Q @ Q.t(), torch.eye(n), atol=1e-5, rtol=0)
    torch.testing.assert_close(Q.t() @ Q, torch.eye(n), atol=1e-5, rtol=0)
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(rh(x), x @ Q.t(), atol=1e-5, rtol=0)
    torch.testing.assert_close(rh.inverse(rh(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rh(rh.inverse(x)), x, atol=1e-5, rtol=0)


def test_seeded_and_reproducible():
    a, b, c = RandomHadamard(96, seed=0), RandomHadamard(96, seed=0), RandomHadamard(96, seed=1)
    assert torch.equal(a.signs, b.signs) and torch.equal(a.matrix(), b.matrix())
    assert set(a.signs.tolist()) == {-1.0, 1.0}
    assert not torch.equal(a.signs, c.signs)


def test_fwht_is_sylvester_hadamard():
    n = 16
    H = torch.ones(1, 1)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fwht(x), x @ H.t() / n**0.5, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.randn(3, 12))


def test_power_of_two_uses_no_dense_factor():
    rh = RandomHadamard(4096, seed=0)
    assert rh.odd == 1 and rh.pow2 == 4096  # only the O(n log n) butterfly, no n × n matrix
    x = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rh.inverse(rh(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rh(x).norm(dim=1), x.norm(dim=1), atol=1e-3, rtol=1e-5)
