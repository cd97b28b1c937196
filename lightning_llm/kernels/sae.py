r"""Sparse-autoencoder (SAE) ops: a sparse decoder, the TopK encoder with a sparse backward, and JumpReLU.

An SAE with ``M`` latents over ``d``-dimensional activations encodes and decodes as::

    pre = x W_encᵀ + b_enc        f = σ(pre)        x̂ = f W_dec + b_dec = Σ_i f_i · W_dec[i] + b_dec

with ``W_enc (M, d)`` in ``nn.Linear`` layout and ``W_dec (M, d)`` holding one decoder direction per row.
``σ`` leaves at most ``k ≪ M`` latents active per row, so the decoder and every gradient through ``f``
only need the ``k`` active ones. These ops take and return ``f`` in that sparse form, ``values (N, k)``
and ``indices (N, k)`` (int64): cost ``N·k·d`` instead of ``N·M·d``.

:func:`sparse_decode` ``(values, indices, weight, bias) -> out``::

    out[n]       = Σ_j values[n, j] · weight[indices[n, j]]  (+ bias)
    d_values[n, j] = ⟨d_out[n], weight[indices[n, j]]⟩            ("gather-dot")
    d_weight[m]  = Σ_{(n, j): indices[n, j] = m} values[n, j] · d_out[n]     (scatter-add)
    d_bias       = Σ_n d_out[n]

:func:`topk_encode` ``(x, weight, bias, k) -> (values, indices)``, the TopK SAE encoder (Gao et al. 2024,
"Scaling and evaluating sparse autoencoders")::

    pre = x weightᵀ + bias        values, indices = topk(relu(pre), k)       (as torch.topk, unsorted)
    g[n, j] = d_values[n, j] · 1[values[n, j] > 0]                          (relu')
    dx[n] = Σ_j g[n, j] · weight[indices[n, j]] = sparse_decode(g, indices, weight)[n]
    d_weight[m] = Σ_{(n, j): indices[n, j] = m} g[n, j] · x[n]      d_bias[m] = Σ_{(n, j): indices[n, j] = m} g[n, j]

Autograd of the dense formula would scatter ``d_values`` into an ``(N, M)`` gradient of ``pre`` and run two
dense ``N × M × d`` matmuls; this backward touches only the ``k`` selected latents per row.

:func:`jumprelu` ``(pre, threshold, bandwidth) -> (acts, l0)``, the JumpReLU SAE activation (Rajamanoharan
et al. 2024, "Jumping Ahead: Improving Reconstruction Fidelity with JumpReLU Sparse Autoencoders"). With
the Heaviside step ``H``, ``θ = threshold`` (one positive threshold per latent; callers pass
``exp(log_threshold)``) and ``ε = bandwidth``::

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

What the Triton kernels (:mod:`._sae_triton`) fuse:

* sparse decode forward: one program per ``(row block, d block)`` tile of ``out`` loops over the ``k``
  active latents, loading each row's index and value and gathering the ``weight`` rows, accumulates in
  fp32, adds the bias and stores ``out`` once (no ``(N, k, d)`` gathered intermediate).
* gather-dot (``d_values``): one program per ``(row block, j)`` loops over ``d``, gathering ``weight`` rows
  and reducing their products with ``d_out`` in fp32.
* ``d_weight`` (and the TopK encoder's ``d_weight``, ``d_bias``) is a transposed gather, run in torch on both
  paths: the ``(n, j)`` pairs are sorted by latent (a stable argsort of ``N·k`` indices) and one
  ``embedding_bag`` sums each latent's token rows. Unlike ``index_add_`` (or ``tl.atomic_add``) this is
  deterministic on CUDA, accumulates in fp32 and rounds once, and needs neither an ``(N·k, d)`` product nor
  an fp32 ``(M, d)`` buffer.
* TopK encoder: its forward is a dense ``N × M × d`` matmul then ``torch.topk`` (cuBLAS/MKL is the right
  tool for the dense pre-activation), so the Triton part of the encoder is its sparse backward: ``dx`` is
  the sparse-decode kernel.
* JumpReLU forward: one elementwise pass per ``(row block, column block)`` tile writes ``acts`` and adds the
  tile's active counts to ``l0`` (``tl.atomic_add`` of integer-valued fp32: exact, so deterministic).
  Backward: one pass writes ``d_pre`` and each row block's partial sums of ``d_θ``, which torch reduces
  (deterministically) and scales by ``−1/ε``.

Precision: sums accumulate in fp32 (fp64 for fp64 inputs, reference only) and round once to the output
dtype, except that the reference adds ``sparse_decode``'s bias after rounding the sum (a second rounding
for 16-bit inputs, which the tests' tolerances account for). ``acts``, ``d_pre`` and ``l0`` (fp32, or fp64
for fp64 ``pre``) are exact on both paths, and ``H`` and ``K`` compare ``pre`` and ``θ`` in that accumulation
dtype. The TopK forward is the same torch computation on both paths (``F.linear`` in the input dtype, then
``torch.topk``), so values and indices agree bitwise.

Indices: the reference path checks ``0 <= indices < M`` (one min/max pass, a device sync on CUDA) and raises
a ValueError. The Triton path assumes validated indices (checking would cost a host sync per call); an
out-of-range index there reads arbitrary memory or faults.

Dispatch follows :mod:`._dispatch`: CUDA tensors of a kernel dtype with Triton importable run the kernels,
everything else (CPU, no Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1``, fp64) the plain-PyTorch references
here, which are the spec. The ops are ``torch.library`` custom ops (``lightning_llm::sparse_decode``,
``::sae_gather_dot``, ``::topk_encode``, ``::jumprelu``, ``::jumprelu_backward``) with fakes and autograd
formulas, so they are opaque to, and work under, ``torch.compile``. ``sparse_decode`` and ``topk_encode``
backwards are built from differentiable ops, so double backward works; JumpReLU's pseudo-derivatives are
first order only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.kernels._dispatch import triton_available, use_triton

__all__ = ["jumprelu", "sparse_decode", "topk_encode"]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BACKENDS = ("auto", "triton", "torch")

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
    """:func:`topk_encode` with the test hooks of :func:`_sparse_decode` (they apply to its backward)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight, bias = (
            t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (x, weight, bias)
        )
    _validate_encode(x, weight, bias, k, _backend, _block)
    values, indices = torch.ops.lightning_llm.topk_encode(
        x.reshape(-1, x.shape[-1]), weight, bias, k, _backend, _block or 0
    )
    return values.reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


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
    """:func:`jumprelu` with the test hooks of :func:`_sparse_decode`."""
    _validate_jumprelu(pre, threshold, bandwidth, _backend, _block)
    acts, l0 = torch.ops.lightning_llm.jumprelu(
        pre.reshape(-1, pre.shape[-1]), threshold, float(bandwidth), _backend, _block or 0
    )
    return acts.reshape(pre.shape), l0.reshape(pre.shape[:-1])


# --------------------------------------------------------------------------------------------------
# Validation (static: shapes, dtypes, devices, scalars), done before the ops so it runs under compile too
# --------------------------------------------------------------------------------------------------


def _validate_common(tensors: dict[str, Tensor | None], backend: str, block: int | None) -> None:
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if backend not in _BACKENDS:
        raise ValueError(f"_backend must be one of {_BACKENDS}, got {backend!r}")
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"_block must be a power of two >= 16, got {block!r}")


def _check_dtypes(first: str, tensors: dict[str, Tensor | None]) -> None:
    """``tensors[first]`` has a supported dtype and every other tensor shares it."""
    dtype = tensors[first].dtype
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{first} dtype must be one of {_SUPPORTED_DTYPES}, got {dtype}")
    for name, t in tensors.items():
        if t is not None and t.dtype != dtype:
            raise TypeError(f"{first} ({dtype}) and {name} ({t.dtype}) must share a dtype")


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
    _check_dtypes("values", {"values": values, "weight": weight, "bias": bias})
    if indices.dtype != torch.int64:
        raise TypeError(f"indices must be int64 (torch.long), got {indices.dtype}")
    _validate_common({"values": values, "indices": indices, "weight": weight, "bias": bias}, backend, block)


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
    _check_dtypes("x", {"x": x, "weight": weight, "bias": bias})
    _validate_common({"x": x, "weight": weight, "bias": bias}, backend, block)


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
    if pre.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"pre dtype must be one of {_SUPPORTED_DTYPES}, got {pre.dtype}")
    if not threshold.dtype.is_floating_point:
        raise TypeError(f"threshold must be floating point, got {threshold.dtype}")
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, (int, float))
        or not math.isfinite(bandwidth)
        or bandwidth <= 0
    ):
        raise ValueError(f"bandwidth must be a positive finite Python number, got {bandwidth!r}")
    _validate_common({"pre": pre, "threshold": threshold}, backend, block)


def _resolve_backend(backend: str, dtype: torch.dtype, *tensors: Tensor | None) -> str:
    """Turn ``"auto"`` into ``"triton"`` (CUDA tensors of a kernel dtype, :func:`use_triton`) or ``"torch"``;
    fail clearly when Triton is forced but cannot run."""
    if backend == "auto":
        present = [t for t in tensors if t is not None]
        return "triton" if dtype in _TRITON_DTYPES and use_triton(*present) else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("_backend='triton' was requested but triton cannot be imported")
        if dtype not in _TRITON_DTYPES:
            raise TypeError(f"the Triton kernels support {_TRITON_DTYPES}, got {dtype}")
    return backend


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


# --------------------------------------------------------------------------------------------------
# References (the specs of the Triton kernels)
# --------------------------------------------------------------------------------------------------


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
    acc = _acc_dtype(grad_out.dtype)
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


def _torch_jumprelu(pre: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor]:
    """``(acts, l0)`` for flat ``pre (N, M)``; ``H`` compares in the accumulation dtype. Both exact."""
    acc = _acc_dtype(pre.dtype)
    active = pre.to(acc) > threshold.to(acc)
    return torch.where(active, pre, 0), active.sum(-1, dtype=acc)


def _torch_jumprelu_backward(
    grad_acts: Tensor | None, grad_l0: Tensor | None, pre: Tensor, threshold: Tensor, bandwidth: float
) -> tuple[Tensor, Tensor]:
    """``(d_pre, d_θ)``: ``d_pre = d_acts · H``, ``d_θ = −(1/ε) Σ_n 1[|pre − θ| < ε/2] (θ d_acts + d_l0)``.

    ``d_pre`` is exact (in ``pre``'s dtype); ``d_θ`` is summed in fp32 (fp64) and cast to ``θ``'s dtype.
    """
    acc = _acc_dtype(pre.dtype)
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


@torch.library.custom_op("lightning_llm::sparse_decode", mutates_args=())
def _sparse_decode_op(
    values: Tensor, indices: Tensor, weight: Tensor, bias: Tensor | None, backend: str, block: int
) -> Tensor:
    """Flat ``values, indices (N, k)`` → ``out (N, d)`` in ``values``' dtype. ``block == 0``: default blocks."""
    with torch.autocast(values.device.type, enabled=False):
        if _resolve_backend(backend, values.dtype, values, indices, weight, bias) == "triton":
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
                grad_bias = grad_out.sum(0, dtype=_acc_dtype(grad_out.dtype)).to(grad_out.dtype)
    return grad_values, None, grad_weight, grad_bias, None, None


_sparse_decode_op.register_autograd(_sparse_decode_backward, setup_context=_sparse_decode_setup_context)


@torch.library.custom_op("lightning_llm::sae_gather_dot", mutates_args=())
def _gather_dot_op(grad_out: Tensor, indices: Tensor, weight: Tensor, backend: str, block: int) -> Tensor:
    """``(N, k)``: ``⟨grad_out[n], weight[indices[n, j]]⟩``, the adjoint of ``sparse_decode`` w.r.t. values."""
    with torch.autocast(grad_out.device.type, enabled=False):
        if _resolve_backend(backend, grad_out.dtype, grad_out, indices, weight) == "triton":
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


@torch.library.custom_op("lightning_llm::topk_encode", mutates_args=())
def _topk_encode_op(
    x: Tensor, weight: Tensor, bias: Tensor, k: int, backend: str, block: int
) -> tuple[Tensor, Tensor]:
    """Flat ``x (N, d)`` → ``values (N, k)`` in ``x``'s dtype and ``indices (N, k)`` int64.

    Dense torch forward on both backends; ``backend`` and ``block`` are for the backward's sparse decode.
    """
    with torch.autocast(x.device.type, enabled=False):
        _resolve_backend(backend, x.dtype, x, weight, bias)  # fail early when Triton is forced but cannot run
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


@torch.library.custom_op("lightning_llm::jumprelu", mutates_args=())
def _jumprelu_op(
    pre: Tensor, threshold: Tensor, bandwidth: float, backend: str, block: int
) -> tuple[Tensor, Tensor]:
    """Flat ``pre (N, M)`` → ``acts (N, M)`` in ``pre``'s dtype and ``l0 (N,)`` in the accumulation dtype."""
    with torch.autocast(pre.device.type, enabled=False):
        if _resolve_backend(backend, pre.dtype, pre, threshold) == "triton":
            from lightning_llm.kernels import _sae_triton

            return _sae_triton.jumprelu_forward(pre, threshold, block)
        return _torch_jumprelu(pre, threshold)


@_jumprelu_op.register_fake
def _(pre, threshold, bandwidth, backend, block):
    return pre.new_empty(pre.shape), pre.new_empty(pre.shape[0], dtype=_acc_dtype(pre.dtype))


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
        if _resolve_backend(backend, pre.dtype, pre, threshold, grad_acts, grad_l0) == "triton":
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
