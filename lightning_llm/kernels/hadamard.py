r"""Seeded random Hadamard rotations, exactly orthogonal for any size (the incoherence transform of QuIP# / QTIP).

A rotation of size ``n`` is ``Q_n S_n``, with ``S`` a diagonal of seeded random ±1 signs and ``Q`` orthonormal.
Quantisers rotate a weight matrix on both sides with it (:mod:`lightning_llm.quantization.hadamard`) so its
entries become close to i.i.d. Gaussian; :func:`~lightning_llm.kernels.trellis_matmul` applies the same
rotations to the activations around its decode-and-matmul.

Sizes. Write ``n = 2^a · r`` with ``r`` odd. We use::

    Q_n = O_r ⊗ H_{2^a} / sqrt(2^a)

with ``H_{2^a}`` the Sylvester (Walsh–)Hadamard matrix, applied by the fast Walsh–Hadamard transform
(``a`` butterfly passes: ``O(n log n)``, never a dense matrix), and ``O_r`` a seeded random orthogonal
``r × r`` matrix (QR of a Gaussian matrix with the sign fix that makes it Haar distributed), applied as a
small dense matmul (``O(n·r)``). The Kronecker product of orthogonal matrices is orthogonal, so ``Q_n`` is
exactly orthogonal (to fp32 rounding) for every ``n``. Why not a Paley Hadamard of size 12 or 20: those
cover only ``n = 2^a·12`` or ``2^a·20`` and need hard-coded matrices; the random orthogonal factor covers
every odd ``r`` with the same code and is at least as incoherent (a Haar rotation of the ``r``-blocks).
For LLM widths ``r`` is small (4096 → 1, 11008 → 43, 14336 → 7); a large prime ``n`` degrades to a dense
``n × n`` rotation (correct, ``O(n²)``).

:class:`RandomHadamard` ``(n, seed)`` acts on the last dimension: ``forward(x) = Q (S x)``, ``inverse(y) =
S Qᵀ y``. Plain PyTorch (no Triton kernel).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["RandomHadamard", "fwht"]


def fwht(x: Tensor) -> Tensor:
    """Orthonormal fast Walsh–Hadamard transform over the last dimension (a power of two)."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {n}")
    shape = x.shape
    h = 1
    while h < n:
        y = x.reshape(*shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return x.reshape(shape) / math.sqrt(n)


def _split(n: int) -> tuple[int, int]:
    p = n & -n  # largest power of two dividing n
    return p, n // p


class RandomHadamard:
    """Seeded random-sign Hadamard rotation of size ``n`` (``Q_n S_n``, see the module docstring)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError(f"n must be positive, got {n}")
        self.n, self.seed = n, seed
        self.pow2, self.odd = _split(n)
        g = torch.Generator().manual_seed(seed)
        self.signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
        if self.odd > 1:
            q, r = torch.linalg.qr(torch.randn(self.odd, self.odd, generator=g, dtype=torch.float64))
            self.odd_matrix = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        else:
            self.odd_matrix = torch.ones(1, 1, dtype=torch.float64)

    def _check(self, x: Tensor) -> None:
        if x.shape[-1] != self.n:
            raise ValueError(f"last dimension must be {self.n}, got {x.shape[-1]}")

    def _apply(self, x: Tensor, transpose: bool) -> Tensor:
        shape = x.shape
        y = fwht(x.reshape(*shape[:-1], self.odd, self.pow2))
        if self.odd > 1:
            o = self.odd_matrix.to(device=x.device, dtype=x.dtype)
            y = torch.matmul(o.t() if transpose else o, y)
        return y.reshape(shape)

    def forward(self, x: Tensor) -> Tensor:
        """``Q (S x)`` over the last dimension."""
        self._check(x)
        return self._apply(x * self.signs.to(device=x.device, dtype=x.dtype), transpose=False)

    __call__ = forward

    def inverse(self, y: Tensor) -> Tensor:
        """``S Qᵀ y`` over the last dimension (the exact inverse of :meth:`forward`)."""
        self._check(y)
        return self._apply(y, transpose=True) * self.signs.to(device=y.device, dtype=y.dtype)

    def matrix(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense ``n × n`` matrix ``Q S`` (tests; ``forward(x) = matrix() @ x``)."""
        return self.forward(torch.eye(self.n, dtype=dtype)).t()
