r"""Random Hadamard incoherence processing of a weight matrix (QuIP# / QTIP style).

A weight matrix ``W [m, n]`` is rotated on both sides before quantisation::

    W̃ = (Q_m S_m) W (Q_n S_n)ᵀ          W = (Q_m S_m)ᵀ W̃ (Q_n S_n)

with ``Q S`` the seeded random Hadamard rotations of :class:`lightning_llm.kernels.hadamard.RandomHadamard`
(exactly orthogonal for any size), so ``W̃`` has the same Frobenius norm, its entries are close to i.i.d.
Gaussian (incoherent: no outlier rows, columns or entries), and the inverse is the transpose. For a layer
``y = W x`` the rotation commutes with the matmul through ``y = (Q_m S_m)ᵀ W̃ (Q_n S_n) x``.
"""

from __future__ import annotations

from torch import Tensor

from lightning_llm.kernels.hadamard import RandomHadamard

__all__ = ["incoherence_process", "incoherence_unprocess"]


def incoherence_process(W: Tensor, seed_out: int, seed_in: int) -> Tensor:
    """``W̃ = (Q_m S_m) W (Q_n S_n)ᵀ`` for ``W [m, n]``."""
    if W.dim() != 2:
        raise ValueError(f"W must be a matrix, got shape {tuple(W.shape)}")
    rh_out, rh_in = RandomHadamard(W.shape[0], seed_out), RandomHadamard(W.shape[1], seed_in)
    return rh_out(rh_in(W).t()).t()


def incoherence_unprocess(Wt: Tensor, seed_out: int, seed_in: int) -> Tensor:
    """The inverse of :func:`incoherence_process`."""
    if Wt.dim() != 2:
        raise ValueError(f"W must be a matrix, got shape {tuple(Wt.shape)}")
    rh_out, rh_in = RandomHadamard(Wt.shape[0], seed_out), RandomHadamard(Wt.shape[1], seed_in)
    return rh_in.inverse(rh_out.inverse(Wt.t()).t())
