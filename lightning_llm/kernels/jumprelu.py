r"""The JumpReLU SAE activation and its per-row L0, with the paper's straight-through pseudo-derivatives.

:func:`jumprelu` ``(pre, threshold, bandwidth) -> (acts, l0)`` (Rajamanoharan et al. 2024, "Jumping Ahead:
Improving Reconstruction Fidelity with JumpReLU Sparse Autoencoders"). With the Heaviside step ``H``,
``θ = threshold`` (one positive threshold per latent; callers pass ``exp(log_threshold)``) and
``ε = bandwidth``::

    JumpReLU_θ(z) = z · H(z − θ)                 acts = JumpReLU_θ(pre)
    ‖f‖₀ = Σ_i H(pre_i − θ_i)                    l0 = ‖f‖₀ per row (the sparsity penalty's term)

``H`` has zero derivative almost everywhere, so the paper trains ``θ`` with straight-through estimators
built on the rectangle kernel ``K(u) = 1[|u| < 1/2]`` (its eqs. 11 and 12)::

    ð/ðθ JumpReLU_θ(z) := −(θ/ε) · K((z − θ)/ε)        ð/ðθ H(z − θ) := −(1/ε) · K((z − θ)/ε)

while the derivatives w.r.t. ``z`` are the true ones, ``H(z − θ)`` and ``0``. The backward is therefore::

    d_pre[n, i] = d_acts[n, i] · H(pre[n, i] − θ_i)
    d_θ_i       = −(1/ε) · Σ_n K((pre[n, i] − θ_i)/ε) · (θ_i · d_acts[n, i] + d_l0[n])

Conventions: ``H(0) = 0`` (``pre > θ`` is active), and the window ``K((pre − θ)/ε)`` is evaluated as
``|pre − θ| < ε/2`` (one rounding fewer; the two agree up to rounding at the window's edge). Plain autograd
cannot express these pseudo-derivatives, hence the custom backward even on the reference path.

What the Triton kernels (:mod:`._sae_triton`) fuse: the forward is one elementwise pass per ``(row block,
column block)`` tile that writes ``acts`` and adds the tile's active counts to ``l0`` (``tl.atomic_add`` of
integer-valued fp32: exact, so deterministic). The backward is one pass that writes ``d_pre`` and each row
block's partial sums of ``d_θ``, which torch reduces (deterministically) and scales by ``−1/ε``.

Precision: ``acts``, ``d_pre`` and ``l0`` (fp32, or fp64 for fp64 ``pre``) are exact on both paths, and
``H`` and ``K`` compare ``pre`` and ``θ`` in that accumulation dtype; ``d_θ`` is summed in fp32 (fp64).

Dispatch follows :mod:`._dispatch` (fp64 runs the reference). The ops are ``torch.library`` custom ops
(``lightning_llm::jumprelu``, ``::jumprelu_backward``) with fakes and an autograd formula, so they are opaque
to, and work under, ``torch.compile``. The pseudo-derivatives are first order only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_llm.kernels._common import SUPPORTED_DTYPES, acc_dtype, check_hooks, check_same_device
from lightning_llm.kernels._dispatch import resolve_backend

__all__ = ["jumprelu"]


def jumprelu(pre: Tensor, threshold: Tensor, bandwidth: float) -> tuple[Tensor, Tensor]:
    r"""JumpReLU activation and per-row L0 with the straight-through pseudo-derivatives of Rajamanoharan et al.

    ``acts = pre · H(pre − θ)``, ``l0 = Σ_i H(pre_i − θ_i)``; gradients flow to ``pre`` (true derivative
    ``H``) and to ``threshold`` (rectangle-kernel estimators of width ``bandwidth``). See the module
    docstring for the equations.

    Args:
        pre: ``(..., M)`` pre-activations, fp32/bf16/fp16 (fp64 on the reference path).
        threshold: ``(M,)`` thresholds ``θ`` (positive, e.g. ``exp(log_threshold)``), any floating dtype.
        bandwidth: ``ε``, a positive finite Python number (the paper uses 0.001 for unit-norm inputs).

    Returns:
        ``acts (..., M)`` in ``pre``'s dtype and ``l0 (...)`` in fp32 (fp64 for fp64 ``pre``), both exact.
        ``d_threshold`` comes back in ``threshold``'s dtype.

    Raises:
        ValueError: inconsistent shapes (the message names them), devices, or a bad ``bandwidth``.
        TypeError: unsupported dtypes.
    """
    return _jumprelu(pre, threshold, bandwidth)


def _jumprelu(
    pre: Tensor,
    threshold: Tensor,
    bandwidth: float,
    *,
    _backend: str = "auto",
    _block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`jumprelu` with test hooks.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block`` forces the Triton row and column blocks (a power of two ≥ 16).
    """
    _validate_jumprelu(pre, threshold, bandwidth, _backend, _block)
    acts, l0 = torch.ops.lightning_llm.jumprelu(
        pre.reshape(-1, pre.shape[-1]), threshold, float(bandwidth), _backend, _block or 0
    )
    return acts.reshape(pre.shape), l0.reshape(pre.shape[:-1])


def _validate_jumprelu(
    pre: Tensor, threshold: Tensor, bandwidth: float, backend: str, block: int | None
) -> None:
    if pre.dim() < 1:
        raise ValueError("pre must have shape (..., M), got a 0-d tensor")
    if tuple(threshold.shape) != (pre.shape[-1],):
        raise ValueError(
            f"threshold must have shape (M,) = ({pre.shape[-1]},) for pre {tuple(pre.shape)}, "
            f"got {tuple(threshold.shape)}"
        )
    if pre.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"pre dtype must be one of {SUPPORTED_DTYPES}, got {pre.dtype}")
    if not threshold.dtype.is_floating_point:
        raise TypeError(f"threshold must be floating point, got {threshold.dtype}")
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, (int, float))
        or not math.isfinite(bandwidth)
        or bandwidth <= 0
    ):
        raise ValueError(f"bandwidth must be a positive finite Python number, got {bandwidth!r}")
    check_same_device((pre, threshold))
    check_hooks(backend, block, min_block=16)


# --------------------------------------------------------------------------------------------------
# References (the specs of the Triton kernels)
# --------------------------------------------------------------------------------------------------


def _torch_jumprelu(pre: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor]:
    """``(acts, l0)`` for flat ``pre (N, M)``; ``H`` compares in the accumulation dtype. Both exact."""
    acc = acc_dtype(pre.dtype)
    active = pre.to(acc) > threshold.to(acc)
    return torch.where(active, pre, 0), active.sum(-1, dtype=acc)


def _torch_jumprelu_backward(
    grad_acts: Tensor | None, grad_l0: Tensor | None, pre: Tensor, threshold: Tensor, bandwidth: float
) -> tuple[Tensor, Tensor]:
    """``(d_pre, d_θ)``: ``d_pre = d_acts · H``, ``d_θ = −(1/ε) Σ_n 1[|pre − θ| < ε/2] (θ d_acts + d_l0)``.

    ``d_pre`` is exact (in ``pre``'s dtype); ``d_θ`` is summed in fp32 (fp64) and cast to ``θ``'s dtype.
    """
    acc = acc_dtype(pre.dtype)
    p, th = pre.to(acc), threshold.to(acc)
    inner = torch.zeros((), dtype=acc, device=pre.device)
    if grad_acts is None:
        grad_pre = torch.zeros_like(pre)
    else:
        grad_pre = torch.where(p > th, grad_acts.to(pre.dtype), 0)
        inner = th * grad_acts.to(acc)
    if grad_l0 is not None:
        inner = inner + grad_l0.to(acc).unsqueeze(-1)
    window = (p - th).abs() < 0.5 * bandwidth
    partial = torch.where(window, inner, 0).sum(0)
    return grad_pre, (partial * (-1.0 / bandwidth)).to(threshold.dtype)


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::jumprelu", mutates_args=())
def _jumprelu_op(
    pre: Tensor, threshold: Tensor, bandwidth: float, backend: str, block: int
) -> tuple[Tensor, Tensor]:
    """Flat ``pre (N, M)`` → ``acts (N, M)`` in ``pre``'s dtype and ``l0 (N,)`` in the accumulation dtype."""
    with torch.autocast(pre.device.type, enabled=False):
        if resolve_backend("jumprelu", backend, (pre, threshold), dtype=pre.dtype) == "triton":
            from lightning_llm.kernels import _sae_triton

            return _sae_triton.jumprelu_forward(pre, threshold, block)
        return _torch_jumprelu(pre, threshold)


@_jumprelu_op.register_fake
def _(pre, threshold, bandwidth, backend, block):
    return pre.new_empty(pre.shape), pre.new_empty(pre.shape[0], dtype=acc_dtype(pre.dtype))


@torch.library.custom_op("lightning_llm::jumprelu_backward", mutates_args=())
def _jumprelu_backward_op(
    grad_acts: Tensor | None,
    grad_l0: Tensor | None,
    pre: Tensor,
    threshold: Tensor,
    bandwidth: float,
    backend: str,
    block: int,
) -> tuple[Tensor, Tensor]:
    """``(d_pre, d_threshold)``; None upstream gradients count as zeros. First order only (STE)."""
    with torch.autocast(pre.device.type, enabled=False):
        tensors = (pre, threshold, grad_acts, grad_l0)
        if resolve_backend("jumprelu_backward", backend, tensors, dtype=pre.dtype) == "triton":
            from lightning_llm.kernels import _sae_triton

            return _sae_triton.jumprelu_backward(grad_acts, grad_l0, pre, threshold, bandwidth, block)
        return _torch_jumprelu_backward(grad_acts, grad_l0, pre, threshold, bandwidth)


@_jumprelu_backward_op.register_fake
def _(grad_acts, grad_l0, pre, threshold, bandwidth, backend, block):
    return torch.empty_like(pre), torch.empty_like(threshold)


def _jumprelu_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    pre, threshold, bandwidth, backend, block = inputs
    ctx.save_for_backward(pre, threshold)
    ctx.config = (bandwidth, backend, block)
    ctx.set_materialize_grads(False)


def _jumprelu_backward(
    ctx: Any, grad_acts: Tensor | None, grad_l0: Tensor | None
) -> tuple[Tensor | None, ...]:
    pre, threshold = ctx.saved_tensors
    bandwidth, backend, block = ctx.config
    if grad_acts is None and grad_l0 is None:
        return None, None, None, None, None
    grad_pre, grad_threshold = torch.ops.lightning_llm.jumprelu_backward(
        grad_acts, grad_l0, pre, threshold, bandwidth, backend, block
    )
    need_pre, need_threshold = ctx.needs_input_grad[:2]
    return (grad_pre if need_pre else None), (grad_threshold if need_threshold else None), None, None, None


_jumprelu_op.register_autograd(_jumprelu_backward, setup_context=_jumprelu_setup_context)
