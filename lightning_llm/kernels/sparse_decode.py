r"""The sparse SAE decoder ``out = Σ_j values_j · weight[indices_j] + bias`` over the active latents only.

A sparse autoencoder (SAE) with ``M`` latents over ``d``-dimensional activations encodes and decodes as::

    pre = x W_encᵀ + b_enc        f = σ(pre)        x̂ = f W_dec + b_dec = Σ_i f_i · W_dec[i] + b_dec

with ``W_enc (M, d)`` in ``nn.Linear`` layout and ``W_dec (M, d)`` holding one decoder direction per row.
``σ`` (TopK, :mod:`.topk_encode`; JumpReLU, :mod:`.jumprelu`) leaves at most ``k ≪ M`` latents active per
row, so the decoder and every gradient through ``f`` only need the ``k`` active ones. The SAE ops take and
return ``f`` in that sparse form, ``values (N, k)`` and ``indices (N, k)`` (int64): cost ``N·k·d`` instead
of ``N·M·d``.

:func:`sparse_decode` ``(values, indices, weight, bias) -> out``::

    out[n]       = Σ_j values[n, j] · weight[indices[n, j]]  (+ bias)
    d_values[n, j] = ⟨d_out[n], weight[indices[n, j]]⟩            ("gather-dot")
    d_weight[m]  = Σ_{(n, j): indices[n, j] = m} values[n, j] · d_out[n]     (scatter-add)
    d_bias       = Σ_n d_out[n]

What the Triton kernels (:mod:`._sae_triton`) fuse:

* forward: one program per ``(row block, d block)`` tile of ``out`` loops over the ``k`` active latents,
  loading each row's index and value and gathering the ``weight`` rows, accumulates in fp32, adds the bias
  and stores ``out`` once (no ``(N, k, d)`` gathered intermediate).
* gather-dot (``d_values``): one program per ``(row block, j)`` loops over ``d``, gathering ``weight`` rows
  and reducing their products with ``d_out`` in fp32.
* ``d_weight`` (and the TopK encoder's ``d_weight``, ``d_bias``) is a transposed gather, run in torch on both
  paths (:func:`_scatter_rows`): the ``(n, j)`` pairs are sorted by latent (a stable argsort of ``N·k``
  indices) and one ``embedding_bag`` sums each latent's token rows. Unlike ``index_add_`` (or
  ``tl.atomic_add``) this is deterministic on CUDA, accumulates in fp32 and rounds once, and needs neither an
  ``(N·k, d)`` product nor an fp32 ``(M, d)`` buffer.

Precision: sums accumulate in fp32 (fp64 for fp64 inputs, reference only) and round once to the output
dtype, except that the reference adds the bias after rounding the sum (a second rounding for 16-bit inputs,
which the tests' tolerances account for).

Indices: the reference path checks ``0 <= indices < M`` (one min/max pass, a device sync on CUDA) and raises
a ValueError. The Triton path assumes validated indices (checking would cost a host sync per call); an
out-of-range index there reads arbitrary memory or faults.

Dispatch follows :mod:`._dispatch`: CUDA tensors of a kernel dtype with Triton importable run the kernels,
everything else (CPU, no Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1``, fp64) the plain-PyTorch references
here, which are the spec. The ops are ``torch.library`` custom ops (``lightning_llm::sparse_decode`` and its
adjoint ``::sae_gather_dot``) with fakes and autograd formulas, so they are opaque to, and work under,
``torch.compile``. The backward is built from differentiable ops, so double backward works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.kernels._common import acc_dtype, check_dtypes, check_hooks, check_same_device
from lightning_llm.kernels._dispatch import resolve_backend

__all__ = ["sparse_decode"]

# The reference gather-dot upcasts gathered weight rows in chunks of at most this many elements (64 MiB fp32).
_CHUNK_ELEMENTS = 2**24


def sparse_decode(values: Tensor, indices: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""``out[n] = Σ_j values[n, j] · weight[indices[n, j]] + bias``: an SAE decoder over the active latents.

    The decoder ``x̂ = Σ_i f_i · W_dec[i] + b_dec`` with ``f`` given sparsely (``k`` active latents per row),
    at cost ``N·k·d`` instead of ``N·M·d``. Differentiable w.r.t. ``values``, ``weight`` and ``bias`` (see
    the module docstring for the formulas and what the Triton kernels fuse).

    Args:
        values: ``(..., k)`` latent activations, fp32/bf16/fp16 (fp64 on the reference path), ``k >= 1``.
        indices: ``(..., k)`` int64 latent ids in ``[0, M)``, same shape as ``values`` (not differentiable).
        weight: ``(M, d)`` decoder directions, one per latent, same dtype and device as ``values``.
        bias: optional ``(d,)`` decoder bias, same dtype.

    Returns:
        ``(..., d)`` in ``values``' dtype, accumulated in fp32 and rounded once (see the module docstring).

    Raises:
        ValueError: inconsistent shapes (the message names them), devices, ``k = 0``, or (reference path)
            an index outside ``[0, M)``.
        TypeError: unsupported or mismatched dtypes, or non-int64 indices.
    """
    return _sparse_decode(values, indices, weight, bias)


def _sparse_decode(
    values: Tensor,
    indices: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    _backend: str = "auto",
    _block: int | None = None,
) -> Tensor:
    """:func:`sparse_decode` with test hooks.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block`` forces the Triton row and column blocks (a power of two ≥ 16) so tests can exercise several
    tiles and ragged edges on small shapes.
    """
    _validate_decode(values, indices, weight, bias, _backend, _block)
    k = values.shape[-1]
    out = torch.ops.lightning_llm.sparse_decode(
        values.reshape(-1, k), indices.reshape(-1, k), weight, bias, _backend, _block or 0
    )
    return out.reshape(*values.shape[:-1], weight.shape[1])


def _validate_decode(
    values: Tensor, indices: Tensor, weight: Tensor, bias: Tensor | None, backend: str, block: int | None
) -> None:
    if values.dim() < 1:
        raise ValueError("values must have shape (..., k), got a 0-d tensor")
    if indices.shape != values.shape:
        raise ValueError(
            f"indices must have the shape of values (..., k) = {tuple(values.shape)}, got {tuple(indices.shape)}"
        )
    if values.shape[-1] < 1:
        raise ValueError(
            f"values must have at least one active latent per row (k >= 1), got {tuple(values.shape)}"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (M, d), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[1],):
        raise ValueError(
            f"bias must have shape (d,) = ({weight.shape[1]},) for weight {tuple(weight.shape)}, "
            f"got {tuple(bias.shape)}"
        )
    check_dtypes("values", {"values": values, "weight": weight, "bias": bias})
    if indices.dtype != torch.int64:
        raise TypeError(f"indices must be int64 (torch.long), got {indices.dtype}")
    check_same_device((values, indices, weight, bias))
    check_hooks(backend, block, min_block=16)


def _check_index_range(indices: Tensor, n_latents: int) -> None:
    """ValueError unless ``0 <= indices < n_latents``: one min/max pass (a host sync on CUDA)."""
    if indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < 0 or hi >= n_latents:
        raise ValueError(f"indices must lie in [0, M) = [0, {n_latents}), got values in [{lo}, {hi}]")


def _torch_sparse_decode(values: Tensor, indices: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Flat ``values, indices (N, k)``: one ``embedding_bag`` (fixed bags of ``k``, per-sample weights).

    ``embedding_bag`` accumulates in fp32 for 16-bit inputs (on CPU and CUDA) and rounds once; the bias is
    then added in a second rounding.
    """
    _check_index_range(indices, weight.shape[0])
    out = F.embedding_bag(indices, weight, per_sample_weights=values, mode="sum")
    return out if bias is None else out + bias


def _torch_gather_dot(grad_out: Tensor, indices: Tensor, weight: Tensor) -> Tensor:
    """``(N, k)``: ``⟨grad_out[n], weight[indices[n, j]]⟩`` in fp32 (fp64), rounded to ``grad_out``'s dtype.

    Row chunks bound the gathered ``(rows, k, d)`` upcast copy to :data:`_CHUNK_ELEMENTS`.
    """
    _check_index_range(indices, weight.shape[0])
    n_rows, k = indices.shape
    acc = acc_dtype(grad_out.dtype)
    out = grad_out.new_empty(n_rows, k)
    step = max(1, _CHUNK_ELEMENTS // max(1, k * weight.shape[1]))
    for start in range(0, n_rows, step):
        rows = F.embedding(indices[start : start + step], weight).to(acc)  # (rows, k, d)
        g = grad_out[start : start + step].to(acc).unsqueeze(-1)  # (rows, d, 1)
        out[start : start + step] = torch.bmm(rows, g).squeeze(-1)
    return out


def _scatter_rows(indices: Tensor, coeffs: Tensor, rows: Tensor, n_latents: int) -> Tensor:
    """``out[m] = Σ_{(n, j): indices[n, j] = m} coeffs[n, j] · rows[n]``: ``(M, rows.shape[1])``, rows' dtype.

    The transpose of :func:`sparse_decode`, as a segment sum: the ``(n, j)`` pairs are sorted by latent
    (stable, so each latent sums its tokens in order) and one ``embedding_bag`` with one bag per latent sums
    the token rows, accumulating in fp32 and rounding once. Deterministic on CUDA, and no ``(N·k, d)``
    product or fp32 ``(M, d)`` buffer. Differentiable w.r.t. ``coeffs`` and ``rows``.
    """
    k = indices.shape[1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.searchsorted(flat[order], torch.arange(n_latents, device=flat.device))
    tokens = torch.div(order, k, rounding_mode="floor")
    return F.embedding_bag(tokens, rows, offsets, mode="sum", per_sample_weights=coeffs.reshape(-1)[order])


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::sparse_decode", mutates_args=())
def _sparse_decode_op(
    values: Tensor, indices: Tensor, weight: Tensor, bias: Tensor | None, backend: str, block: int
) -> Tensor:
    """Flat ``values, indices (N, k)`` → ``out (N, d)`` in ``values``' dtype. ``block == 0``: default blocks."""
    with torch.autocast(values.device.type, enabled=False):
        tensors = (values, indices, weight, bias)
        if resolve_backend("sparse_decode", backend, tensors, dtype=values.dtype) == "triton":
            from lightning_llm.kernels import _sae_triton

            return _sae_triton.sparse_decode_forward(values, indices, weight, bias, block)
        return _torch_sparse_decode(values, indices, weight, bias)


@_sparse_decode_op.register_fake
def _(values, indices, weight, bias, backend, block):
    return values.new_empty(values.shape[0], weight.shape[1])


def _sparse_decode_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    values, indices, weight, _bias, backend, block = inputs
    ctx.save_for_backward(values, indices, weight)
    ctx.config = (backend, block)
    ctx.set_materialize_grads(False)


def _sparse_decode_backward(ctx: Any, grad_out: Tensor | None) -> tuple[Tensor | None, ...]:
    """``d_values`` (gather-dot op), ``d_weight`` (:func:`_scatter_rows`), ``d_bias``, each only when needed."""
    values, indices, weight = ctx.saved_tensors
    backend, block = ctx.config
    need_values, _, need_weight, need_bias = ctx.needs_input_grad[:4]
    grad_values = grad_weight = grad_bias = None
    if grad_out is not None:
        with torch.autocast(values.device.type, enabled=False):
            if need_values:
                grad_values = torch.ops.lightning_llm.sae_gather_dot(
                    grad_out, indices, weight, backend, block
                )
            if need_weight:
                grad_weight = _scatter_rows(indices, values, grad_out, weight.shape[0])
            if need_bias:
                grad_bias = grad_out.sum(0, dtype=acc_dtype(grad_out.dtype)).to(grad_out.dtype)
    return grad_values, None, grad_weight, grad_bias, None, None


_sparse_decode_op.register_autograd(_sparse_decode_backward, setup_context=_sparse_decode_setup_context)


@torch.library.custom_op("lightning_llm::sae_gather_dot", mutates_args=())
def _gather_dot_op(grad_out: Tensor, indices: Tensor, weight: Tensor, backend: str, block: int) -> Tensor:
    """``(N, k)``: ``⟨grad_out[n], weight[indices[n, j]]⟩``, the adjoint of ``sparse_decode`` w.r.t. values."""
    with torch.autocast(grad_out.device.type, enabled=False):
        tensors = (grad_out, indices, weight)
        if resolve_backend("sae_gather_dot", backend, tensors, dtype=grad_out.dtype) == "triton":
            from lightning_llm.kernels import _sae_triton

            return _sae_triton.gather_dot(grad_out, indices, weight, block)
        return _torch_gather_dot(grad_out, indices, weight)


@_gather_dot_op.register_fake
def _(grad_out, indices, weight, backend, block):
    return grad_out.new_empty(indices.shape)


def _gather_dot_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    grad_out, indices, weight, backend, block = inputs
    ctx.save_for_backward(grad_out, indices, weight)
    ctx.config = (backend, block)
    ctx.set_materialize_grads(False)


def _gather_dot_backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, ...]:
    """Bilinear in ``grad_out`` and ``weight``: ``sparse_decode(grad, indices, weight)`` and the scatter."""
    grad_out, indices, weight = ctx.saved_tensors
    backend, block = ctx.config
    need_g, _, need_weight = ctx.needs_input_grad[:3]
    d_g = d_weight = None
    if grad is not None:
        with torch.autocast(grad_out.device.type, enabled=False):
            if need_g:
                d_g = torch.ops.lightning_llm.sparse_decode(grad, indices, weight, None, backend, block)
            if need_weight:
                d_weight = _scatter_rows(indices, grad, grad_out, weight.shape[0])
    return d_g, None, d_weight, None, None


_gather_dot_op.register_autograd(_gather_dot_backward, setup_context=_gather_dot_setup_context)
