r"""A linear layer plus its (column-scaled) LoRA branch in one op: ``y = x Wᵀ + b + s·((x Aᵀ) ⊙ c) Bᵀ``.

Shapes (PEFT's layouts, so ``lora_A.weight`` / ``lora_B.weight`` go in unchanged)::

    x : (..., in)     activations, flattened to (N, in)
    W : (out, in)     frozen base weight (nn.Linear layout)
    b : (out,)        optional base bias
    A : (r, in)       lora_A.weight
    B : (out, r)      lora_B.weight
    s : float         alpha / r (or alpha / √r for rsLoRA)
    c : (r,)          optional per-rank column scales (ScaLoRA); None means all ones
    y : (..., out)

In the issue's notation, with ``A`` standing for ``lora_A.weightᵀ`` (``in × r``), the same equation reads
``y = x Wᵀ + s·((x A) ⊙ c) Bᵀ``.

Backward, with ``t = x Aᵀ`` and ``u = dy B`` (both ``N × r``)::

    dx = dy W + s·(u ⊙ c) A        dA = s·(u ⊙ c)ᵀ x        dB = s·dyᵀ (t ⊙ c)
    dW = dyᵀ x                     db = Σ_N dy              dc = s·Σ_N (t ⊙ u)

What is fused, and why (the Triton path, :mod:`._lora_linear_triton`): one kernel computes each
``BLOCK_M × BLOCK_N`` output tile. Its loop over ``in`` loads every tile of ``x`` once and feeds it to two
products, the base ``x Wᵀ`` and the rank-``r`` ``t = x Aᵀ``; the epilogue then adds ``s·(t ⊙ c) Bᵀ`` for that
tile (one ``BLOCK_M × r × BLOCK_N`` product) and the bias, and stores the result once. Compared with the
unfused ``linear(x, W, b) + s * linear(linear(x, A) * c, B)`` this reads ``x`` once instead of twice and
never writes or re-reads an ``N × out`` intermediate for the LoRA branch (nor the sum). The price is that
every column tile of a row block recomputes that row block's ``t``: ``r / BLOCK_N`` more work than the base
GEMM (``r`` padded to at least 16 for the tensor cores), small for LoRA ranks. The first column tile also
stores ``t`` (fp32), which backward reuses. Backward's ``dx = dy W + s·((dy B) ⊙ c) A`` has the same shape
with roles swapped, so it is the same op (and kernel) called on ``(dy, Wᵀ, Bᵀ, Aᵀ)`` (free transposed
views: the kernel takes strides), which also yields ``u = dy B``. The weight gradients ``dA``, ``dB``,
``dW`` reduce over tokens, a different tiling; they are plain ``torch`` matmuls.

Precision: products accumulate in fp32, and the kernel rounds its output once to the input dtype. ``t``
and ``u`` are kept in fp32; the scaled rank-``r`` factors ``s·(t ⊙ c)`` and ``s·(u ⊙ c)`` are rounded to
the input dtype before their matmul with ``B`` / ``A`` / ``x`` / ``dy`` (16-bit tensor-core matmuls, as
unfused LoRA does). fp32 inputs use TF32 in the Triton kernel exactly when ``torch.backends.cuda.matmul.allow_tf32`` is
set, as torch's own matmuls do.

Dispatch follows :mod:`._dispatch`: CUDA tensors with Triton importable run the kernel, everything else
(CPU, no Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1``, fp64, rank above :data:`MAX_TRITON_RANK`) runs
:func:`_torch_lora_linear`, the plain-PyTorch spec of the kernel. The op is the ``torch.library`` custom op
``lightning_llm::lora_linear`` (outputs ``y`` and ``t``) with a fake and an autograd formula, so it is
opaque to, and works under, ``torch.compile``; its backward only uses differentiable ops (itself
included), so double backward works too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_llm.kernels._common import autocast_inputs, check_dtypes, check_hooks, check_same_device
from lightning_llm.kernels._dispatch import resolve_backend

__all__ = ["MAX_TRITON_RANK", "lora_linear"]

#: Largest LoRA rank the Triton kernel takes: its ``BLOCK_M × r`` fp32 accumulator and ``BLOCK_K × r`` tile
#: live in registers / shared memory next to the output tile. Larger ranks use the reference path.
MAX_TRITON_RANK = 256


def lora_linear(
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    scale: float,
    column_scale: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    r"""``x Wᵀ + bias + scale·((x Aᵀ) ⊙ column_scale) Bᵀ``: a frozen linear layer plus its LoRA branch.

    In the issue's notation (``A`` there is ``lora_A.weightᵀ``): ``y = x Wᵀ + s·((x A) ⊙ c) Bᵀ``. On CUDA
    one fused Triton kernel computes it (see the module docstring for what is fused); elsewhere plain
    PyTorch does. Differentiable w.r.t. every tensor argument.

    Args:
        x: ``(..., in)`` activations, fp32/bf16/fp16 (fp64 on the reference path).
        weight: ``(out, in)`` base weight ``W`` (``nn.Linear.weight``), same dtype and device as ``x``.
        A: ``(r, in)`` LoRA down-projection (PEFT's ``lora_A.weight``), same dtype.
        B: ``(out, r)`` LoRA up-projection (PEFT's ``lora_B.weight``), same dtype.
        scale: ``s``, a finite Python number (``alpha / r`` for LoRA).
        column_scale: optional ``(r,)`` per-rank scales ``c`` (ScaLoRA), any floating dtype; None = ones.
        bias: optional ``(out,)`` base bias, same dtype as ``x``.

    Returns:
        ``(..., out)`` in ``x``'s dtype. Products accumulate in fp32; see the module docstring for where
        intermediate values are rounded.

    Under ``torch.autocast`` the tensors (except ``column_scale``) are cast to the autocast dtype first,
    as ``nn.Linear`` would be; otherwise they must share a dtype.

    Raises:
        ValueError: inconsistent shapes (the message names them), devices, or a non-finite ``scale``.
        TypeError: unsupported or mismatched dtypes.
    """
    return _lora_linear(x, weight, A, B, scale, column_scale, bias)


def _lora_linear(
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    scale: float,
    column_scale: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    _backend: str = "auto",
    _block: int | None = None,
) -> Tensor:
    """:func:`lora_linear` with test hooks.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block`` forces the Triton row, column and reduction blocks (a power of two ≥ 16) so tests can
    exercise several tiles and ragged edges on small shapes.
    """
    x, weight, A, B, bias = autocast_inputs(x.device.type, x, weight, A, B, bias)
    _validate(x, weight, A, B, scale, column_scale, bias, _backend, _block)
    y, _ = torch.ops.lightning_llm.lora_linear(
        x.reshape(-1, x.shape[-1]), weight, A, B, column_scale, bias, float(scale), _backend, _block or 0
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _validate(
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    scale: float,
    column_scale: Tensor | None,
    bias: Tensor | None,
    backend: str,
    block: int | None,
) -> None:
    """Static checks (shapes, dtypes, devices, scalars), done before the op so they run under compile too."""
    if x.dim() < 1:
        raise ValueError("x must have shape (..., in), got a 0-d tensor")
    for name, t, layout in (("weight", weight, "(out, in)"), ("A", A, "(r, in)"), ("B", B, "(out, r)")):
        if t.dim() != 2:
            raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    n_in, n_out, rank = x.shape[-1], weight.shape[0], A.shape[0]
    if weight.shape[1] != n_in:
        raise ValueError(
            f"in-features mismatch: x is {tuple(x.shape)} but weight is {tuple(weight.shape)} "
            f"(expected (out, {n_in}))"
        )
    if A.shape[1] != n_in:
        raise ValueError(
            f"in-features mismatch: x is {tuple(x.shape)} but A is {tuple(A.shape)} "
            f"(expected (r, {n_in}), PEFT's lora_A.weight layout)"
        )
    if rank < 1:
        raise ValueError(f"A must have at least one row (rank r >= 1), got {tuple(A.shape)}")
    if B.shape[0] != n_out:
        raise ValueError(
            f"out-features mismatch: weight is {tuple(weight.shape)} but B is {tuple(B.shape)} "
            f"(expected ({n_out}, r), PEFT's lora_B.weight layout)"
        )
    if B.shape[1] != rank:
        raise ValueError(
            f"rank mismatch: A is {tuple(A.shape)} (r = {rank}) but B is {tuple(B.shape)} "
            f"(expected ({n_out}, {rank}))"
        )
    if column_scale is not None and tuple(column_scale.shape) != (rank,):
        raise ValueError(
            f"column_scale must have shape (r,) = ({rank},) for A {tuple(A.shape)}, "
            f"got {tuple(column_scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(
            f"bias must have shape (out,) = ({n_out},) for weight {tuple(weight.shape)}, "
            f"got {tuple(bias.shape)}"
        )
    check_dtypes(
        "x",
        {"x": x, "weight": weight, "A": A, "B": B, "bias": bias},
        hint="; cast one of them or use torch.autocast",
    )
    if column_scale is not None and not column_scale.dtype.is_floating_point:
        raise TypeError(f"column_scale must be floating point, got {column_scale.dtype}")
    check_same_device((x, weight, A, B, column_scale, bias))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    check_hooks(backend, block, min_block=16)


# --------------------------------------------------------------------------------------------------
# Reference (the spec of the Triton kernel) and dispatch
# --------------------------------------------------------------------------------------------------


def _torch_lora_linear(
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    column_scale: Tensor | None,
    bias: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(y, t)`` for flat ``x (N, in)``: the plain-PyTorch spec of the kernel.

    ``t = x Aᵀ`` accumulated in fp32 (fp64 for fp64 input), ``y = x Wᵀ + (s·(t ⊙ c) rounded to the input
    dtype) Bᵀ + bias``, summed in fp32 and rounded to the input dtype. Unlike the kernel, each of the two
    products in ``y`` is also rounded to the input dtype here, which the tests' tolerances account for.
    Memory is not a concern of this path: it makes fp32 copies of ``x`` and ``y``.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    t = x.to(acc) @ A.to(acc).T
    factor = scale if column_scale is None else scale * column_scale.to(acc)
    y = torch.nn.functional.linear(x, weight).to(acc)
    y += torch.nn.functional.linear((t * factor).to(x.dtype), B)
    if bias is not None:
        y += bias
    return y.to(x.dtype), t


def _resolve_backend(
    backend: str,
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    column_scale: Tensor | None,
    bias: Tensor | None,
) -> str:
    """:func:`~._dispatch.resolve_backend` with this kernel's limits: a kernel dtype and a rank at most
    :data:`MAX_TRITON_RANK`."""
    tensors = (x, weight, A, B, column_scale, bias)
    limits = (("ranks", A.shape[0], MAX_TRITON_RANK),)
    return resolve_backend("lora_linear", backend, tensors, dtype=x.dtype, limits=limits)


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::lora_linear", mutates_args=())
def _lora_linear_op(
    x: Tensor,
    weight: Tensor,
    A: Tensor,
    B: Tensor,
    column_scale: Tensor | None,
    bias: Tensor | None,
    scale: float,
    backend: str,
    block: int,
) -> tuple[Tensor, Tensor]:
    """Flat ``x (N, in)`` op returning ``y (N, out)`` in ``x``'s dtype and ``t = x Aᵀ (N, r)`` in fp32.

    ``block == 0`` means the default Triton blocks. Autocast is switched off inside: the public function
    has already applied it to the inputs, and the reference's matmuls must keep the input dtype.
    """
    with torch.autocast(x.device.type, enabled=False):
        if _resolve_backend(backend, x, weight, A, B, column_scale, bias) == "triton":
            from lightning_llm.kernels import _lora_linear_triton

            return _lora_linear_triton.lora_linear_forward(x, weight, A, B, column_scale, bias, scale, block)
        return _torch_lora_linear(x, weight, A, B, column_scale, bias, scale)


@_lora_linear_op.register_fake
def _(x, weight, A, B, column_scale, bias, scale, backend, block):
    acc = torch.promote_types(x.dtype, torch.float32)
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], A.shape[0], dtype=acc)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    """Save ``x, W, A, B, c`` and the forward's ``t`` (not ``y``); unused output grads arrive as None."""
    x, weight, A, B, column_scale, _bias, scale, backend, block = inputs
    ctx.save_for_backward(x, weight, A, B, column_scale, output[1])
    ctx.config = (scale, backend, block)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_y: Tensor | None, grad_t: Tensor | None) -> tuple[Tensor | None, ...]:
    """Gradients of ``(y, t)`` w.r.t. ``x, W, A, B, c, bias``, each computed only when needed.

    ``dx`` (and ``u = dy B``) come from the forward op itself on ``(dy, Wᵀ, Bᵀ, Aᵀ)``; when ``x`` needs no
    gradient but ``A`` or ``c`` does, ``u`` is a torch matmul. A gradient of ``t`` (only when ``t`` is used,
    e.g. by double backward) adds ``dt A`` to ``dx`` and ``dtᵀ x`` to ``dA``.
    """
    x, weight, A, B, column_scale, t = ctx.saved_tensors
    scale, backend, block = ctx.config
    need_x, need_w, need_a, need_b, need_c, need_bias = ctx.needs_input_grad[:6]
    if grad_y is None:
        grad_y = x.new_zeros(x.shape[0], weight.shape[0])
    acc = t.dtype
    factor = scale if column_scale is None else scale * column_scale.to(acc)
    grad_x = grad_w = grad_a = grad_b = grad_c = grad_bias = None
    with torch.autocast(x.device.type, enabled=False):
        u = None
        if need_x:
            grad_x, u = torch.ops.lightning_llm.lora_linear(
                grad_y, weight.T, B.T, A.T, column_scale, None, scale, backend, block
            )
        elif need_a or need_c:
            u = grad_y.to(acc) @ B.to(acc)
        if need_a:
            grad_t_total = u * factor if grad_t is None else u * factor + grad_t
            grad_a = grad_t_total.to(x.dtype).T @ x
        if need_x and grad_t is not None:
            grad_x = grad_x + grad_t.to(x.dtype) @ A
        if need_b:
            grad_b = grad_y.T @ (t * factor).to(x.dtype)
        if need_c:
            grad_c = (scale * (t * u).sum(0)).to(column_scale.dtype)
        if need_w:
            grad_w = grad_y.T @ x
        if need_bias:
            grad_bias = grad_y.sum(0, dtype=acc).to(x.dtype)
    return grad_x, grad_w, grad_a, grad_b, grad_c, grad_bias, None, None, None


_lora_linear_op.register_autograd(_backward, setup_context=_setup_context)
