r"""The TopK SAE encoder ``values, indices = topk(relu(x weightᵀ + bias), k)`` with a sparse backward.

The encoder of a TopK sparse autoencoder (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"),
returning the active latents in the sparse form of :mod:`.sparse_decode` (``values (N, k)``, ``indices (N, k)``
int64)::

    pre = x weightᵀ + bias        values, indices = topk(relu(pre), k)       (as torch.topk, unsorted)
    g[n, j] = d_values[n, j] · 1[values[n, j] > 0]                          (relu')
    dx[n] = Σ_j g[n, j] · weight[indices[n, j]] = sparse_decode(g, indices, weight)[n]
    d_weight[m] = Σ_{(n, j): indices[n, j] = m} g[n, j] · x[n]      d_bias[m] = Σ_{(n, j): indices[n, j] = m} g[n, j]

Autograd of the dense formula would scatter ``d_values`` into an ``(N, M)`` gradient of ``pre`` and run two
dense ``N × M × d`` matmuls; this backward touches only the ``k`` selected latents per row.

The forward is a dense ``N × M × d`` matmul then ``torch.topk`` (cuBLAS/MKL is the right tool for the dense
pre-activation), the same torch computation on both paths (``F.linear`` in the input dtype, then
``torch.topk``), so values and indices agree bitwise. The Triton part of the encoder is its sparse
backward: ``dx`` is the sparse-decode kernel, and ``d_weight``, ``d_bias`` are the deterministic segment
sums of :mod:`.sparse_decode` (one sort of the indices for both).

Dispatch follows :mod:`._dispatch` (fp64 runs the reference). The op is the ``torch.library`` custom op
``lightning_llm::topk_encode`` with a fake and an autograd formula, so it is opaque to, and works under,
``torch.compile``; its backward is built from differentiable ops, so double backward works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.kernels._common import autocast_inputs, check_dtypes, check_hooks, check_same_device
from lightning_llm.kernels._dispatch import resolve_backend
from lightning_llm.kernels.sparse_decode import _scatter_rows

__all__ = ["topk_encode"]


def topk_encode(x: Tensor, weight: Tensor, bias: Tensor, k: int) -> tuple[Tensor, Tensor]:
    r"""The TopK SAE encoder: ``values, indices = topk(relu(x weightᵀ + bias), k)`` with a sparse backward.

    Differentiable w.r.t. ``x``, ``weight`` and ``bias`` through ``values`` (``indices`` are integers).
    The forward is a dense torch matmul and ``torch.topk``; the backward only touches the ``k`` selected
    latents per row (``dx`` is :func:`sparse_decode`, on CUDA its Triton kernel). See the module docstring.

    Args:
        x: ``(..., d)`` activations, fp32/bf16/fp16 (fp64 on the reference path).
        weight: ``(M, d)`` encoder weight (``nn.Linear.weight`` layout), same dtype and device as ``x``.
        bias: ``(M,)`` encoder bias, same dtype.
        k: number of active latents per row, ``1 <= k <= M``.

    Returns:
        ``values (..., k)`` in ``x``'s dtype, all ``>= 0`` and in descending order, and ``indices (..., k)``
        (int64). Rows with fewer than ``k`` positive pre-activations get zeros (at indices chosen by
        ``torch.topk``), whose gradients are zero.

    Under ``torch.autocast`` the tensors are cast to the autocast dtype first, as ``nn.Linear``'s would be;
    otherwise they must share a dtype.

    Raises:
        ValueError: inconsistent shapes (the message names them), devices, or ``k`` outside ``[1, M]``.
        TypeError: unsupported or mismatched dtypes, or a non-integer ``k``.
    """
    return _topk_encode(x, weight, bias, k)


def _topk_encode(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    k: int,
    *,
    _backend: str = "auto",
    _block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`topk_encode` with test hooks for its backward's sparse decode.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block`` forces the Triton row and column blocks (a power of two ≥ 16).
    """
    x, weight, bias = autocast_inputs(x.device.type, x, weight, bias)
    _validate_encode(x, weight, bias, k, _backend, _block)
    values, indices = torch.ops.lightning_llm.topk_encode(
        x.reshape(-1, x.shape[-1]), weight, bias, k, _backend, _block or 0
    )
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


def _validate_encode(
    x: Tensor, weight: Tensor, bias: Tensor, k: int, backend: str, block: int | None
) -> None:
    if x.dim() < 1:
        raise ValueError("x must have shape (..., d), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (M, d) (nn.Linear layout), got {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"feature mismatch: x is {tuple(x.shape)} but weight is {tuple(weight.shape)} "
            f"(expected (M, {x.shape[-1]}))"
        )
    n_latents = weight.shape[0]
    if tuple(bias.shape) != (n_latents,):
        raise ValueError(
            f"bias must have shape (M,) = ({n_latents},) for weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
        )
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be a Python int, got {k!r}")
    if not 1 <= k <= n_latents:
        raise ValueError(f"k must be in [1, M] = [1, {n_latents}] for weight {tuple(weight.shape)}, got {k}")
    check_dtypes("x", {"x": x, "weight": weight, "bias": bias})
    check_same_device((x, weight, bias))
    check_hooks(backend, block, min_block=16)


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::topk_encode", mutates_args=())
def _topk_encode_op(
    x: Tensor, weight: Tensor, bias: Tensor, k: int, backend: str, block: int
) -> tuple[Tensor, Tensor]:
    """Flat ``x (N, d)`` → ``values (N, k)`` in ``x``'s dtype and ``indices (N, k)`` int64.

    Dense torch forward on both backends; ``backend`` and ``block`` are for the backward's sparse decode.
    """
    with torch.autocast(x.device.type, enabled=False):
        # fail early when Triton is forced but cannot run
        resolve_backend("topk_encode", backend, (x, weight, bias), dtype=x.dtype)
        # Unsorted: the k latents' order carries no meaning, and sorting them costs ~10% of the encoder.
        values, indices = torch.topk(torch.relu(F.linear(x, weight, bias)), k, dim=-1, sorted=False)
        return values, indices


@_topk_encode_op.register_fake
def _(x, weight, bias, k, backend, block):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.int64)


def _topk_encode_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _bias, _k, backend, block = inputs
    ctx.save_for_backward(x, weight, *output)
    ctx.config = (backend, block)
    ctx.set_materialize_grads(False)


def _topk_encode_backward(
    ctx: Any, grad_values: Tensor | None, _grad_indices: Tensor | None
) -> tuple[Tensor | None, ...]:
    """Sparse backward: ``g = d_values · 1[values > 0]``, ``dx = sparse_decode(g, indices, weight)``,
    ``d_weight``/``d_bias`` scatter ``g·x``/``g`` to the selected latents (:func:`_scatter_rows`)."""
    x, weight, values, indices = ctx.saved_tensors
    backend, block = ctx.config
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_x = grad_weight = grad_bias = None
    if grad_values is not None:
        with torch.autocast(x.device.type, enabled=False):
            g = torch.where(values > 0, grad_values.to(x.dtype), 0)
            if need_x:
                grad_x = torch.ops.lightning_llm.sparse_decode(g, indices, weight, None, backend, block)
            if need_weight and need_bias:  # one segment sum (one sort of the indices) for both: rows [x | 1]
                both = _scatter_rows(
                    indices, g, torch.cat([x, x.new_ones(x.shape[0], 1)], 1), weight.shape[0]
                )
                grad_weight, grad_bias = both[:, :-1], both[:, -1]
            elif need_weight:
                grad_weight = _scatter_rows(indices, g, x, weight.shape[0])
            elif need_bias:
                grad_bias = _scatter_rows(indices, g, x.new_ones(x.shape[0], 1), weight.shape[0]).squeeze(1)
    return grad_x, grad_weight, grad_bias, None, None, None


_topk_encode_op.register_autograd(_topk_encode_backward, setup_context=_topk_encode_setup_context)
