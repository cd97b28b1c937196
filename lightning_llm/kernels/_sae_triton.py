"""Triton kernels for the SAE ops :mod:`~lightning_llm.kernels.sparse_decode`,
:mod:`~lightning_llm.kernels.topk_encode` (its backward) and :mod:`~lightning_llm.kernels.jumprelu`.

Kept in its own module because ``@triton.jit`` needs ``triton.language`` among the module globals (the
interpreter patches it there) and decides between compiled and interpreted execution when the decorator
runs. Importing this module therefore imports Triton; the op modules only do so on first use of the Triton
path.

With ``values, indices (N, k)``, ``weight (M, d)``, ``pre (N, M)`` and ``θ (M,)``:

* :func:`_sparse_decode_kernel`: ``out[n] = Σ_j values[n, j] · weight[indices[n, j]] (+ bias)``.
* :func:`_gather_dot_kernel`: ``d_values[n, j] = ⟨d_out[n], weight[indices[n, j]]⟩``.
* :func:`_jumprelu_forward_kernel`: ``acts = pre · 1[pre > θ]`` and ``l0[n] += Σ_i 1[pre > θ]`` per tile.
* :func:`_jumprelu_backward_kernel`: ``d_pre = d_acts · 1[pre > θ]`` and, per row block,
  ``Σ_n 1[|pre − θ| < ε/2] · (θ · d_acts + d_l0)``.

None of them uses ``tl.dot``: the products are gathers and elementwise work. Sums accumulate in fp32;
16-bit outputs are rounded once, to nearest even also under the interpreter (:func:`_downcast`). Every
operand is passed with its strides, so views (e.g. an expanded upstream gradient) need no copy. Indices
are assumed to lie in ``[0, M)``; :mod:`~lightning_llm.kernels.sparse_decode` documents why they are not checked here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_llm.kernels._lora_linear_triton import _downcast


@triton.jit
def _sparse_decode_kernel(
    val_ptr,
    idx_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    N,
    K,
    D,
    stride_vn,
    stride_vk,
    stride_in,
    stride_ik,
    stride_wm,
    stride_wd,
    stride_bias,
    stride_on,
    stride_od,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per ``BLOCK_N × BLOCK_D`` tile of ``out``: loop over the ``K`` active latents.

    Each step loads the tile rows' ``j``-th index and value, gathers the ``BLOCK_N`` weight rows'
    ``BLOCK_D`` columns and accumulates ``value · row`` in fp32; the epilogue adds the bias and stores once.
    """
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    mask_d = offs_d < D
    mask = mask_n[:, None] & mask_d[None, :]
    rows = offs_n.to(tl.int64)
    cols = offs_d.to(tl.int64)

    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for j in range(0, K):
        idx = tl.load(idx_ptr + rows * stride_in + j * stride_ik, mask=mask_n, other=0)
        val = tl.load(val_ptr + rows * stride_vn + j * stride_vk, mask=mask_n, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + idx[:, None] * stride_wm + cols[None, :] * stride_wd, mask=mask, other=0.0)
        acc += val[:, None] * w.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_bias, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_on + cols[None, :] * stride_od
    tl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _gather_dot_kernel(
    g_ptr,
    idx_ptr,
    w_ptr,
    out_ptr,
    N,
    D,
    stride_gn,
    stride_gd,
    stride_in,
    stride_ik,
    stride_wm,
    stride_wd,
    stride_on,
    stride_ok,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per ``(BLOCK_N rows, latent slot j)``: loop over ``D``, reduce ``g · weight row`` in fp32."""
    pid_n = tl.program_id(0)
    j = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)

    idx = tl.load(idx_ptr + rows * stride_in + j * stride_ik, mask=mask_n, other=0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + offs_d).to(tl.int64)
        mask = mask_n[:, None] & (cols < D)[None, :]
        g = tl.load(g_ptr + rows[:, None] * stride_gn + cols[None, :] * stride_gd, mask=mask, other=0.0)
        w = tl.load(w_ptr + idx[:, None] * stride_wm + cols[None, :] * stride_wd, mask=mask, other=0.0)
        acc += tl.sum(g.to(tl.float32) * w.to(tl.float32), axis=1)
    out = _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + rows * stride_on + j * stride_ok, out, mask=mask_n)


@triton.jit
def _jumprelu_forward_kernel(
    pre_ptr,
    th_ptr,
    acts_ptr,
    l0_ptr,
    N,
    M,
    stride_pn,
    stride_pm,
    stride_th,
    stride_an,
    stride_am,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One program per ``BLOCK_N × BLOCK_M`` tile: store ``acts``, add the tile's active counts to ``l0``.

    ``acts`` is ``pre`` itself or zero, so it is stored without rounding. The counts are integers, so the
    fp32 atomic adds are exact and their order does not matter (``l0`` must be zero-initialised).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    mask = mask_n[:, None] & mask_m[None, :]
    rows = offs_n.to(tl.int64)
    cols = offs_m.to(tl.int64)

    p = tl.load(pre_ptr + rows[:, None] * stride_pn + cols[None, :] * stride_pm, mask=mask, other=0.0)
    th = tl.load(th_ptr + cols * stride_th, mask=mask_m, other=0.0).to(tl.float32)
    active = (p.to(tl.float32) > th[None, :]) & mask
    acts = tl.where(active, p, tl.zeros_like(p))
    tl.store(acts_ptr + rows[:, None] * stride_an + cols[None, :] * stride_am, acts, mask=mask)
    tl.atomic_add(l0_ptr + rows, tl.sum(active.to(tl.float32), axis=1), mask=mask_n)


@triton.jit
def _jumprelu_backward_kernel(
    ga_ptr,
    gl_ptr,
    pre_ptr,
    th_ptr,
    gpre_ptr,
    part_ptr,
    N,
    M,
    stride_gan,
    stride_gam,
    stride_gl,
    stride_pn,
    stride_pm,
    stride_th,
    stride_gpn,
    stride_gpm,
    stride_part,
    half_bandwidth,
    HAS_GRAD_ACTS: tl.constexpr,
    HAS_GRAD_L0: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One program per ``BLOCK_N × BLOCK_M`` tile: store ``d_pre`` and this row block's ``d_θ`` partial sums.

    ``part[pid_n, i] = Σ_{n in block} 1[|pre − θ_i| < ε/2] · (θ_i · d_acts[n, i] + d_l0[n])`` in fp32;
    the caller sums over row blocks and scales by ``−1/ε``.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    mask = mask_n[:, None] & mask_m[None, :]
    rows = offs_n.to(tl.int64)
    cols = offs_m.to(tl.int64)

    p = tl.load(pre_ptr + rows[:, None] * stride_pn + cols[None, :] * stride_pm, mask=mask, other=0.0)
    p = p.to(tl.float32)
    th = tl.load(th_ptr + cols * stride_th, mask=mask_m, other=0.0).to(tl.float32)
    gpre_ptrs = gpre_ptr + rows[:, None] * stride_gpn + cols[None, :] * stride_gpm
    inner = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if HAS_GRAD_ACTS:
        ga = tl.load(ga_ptr + rows[:, None] * stride_gan + cols[None, :] * stride_gam, mask=mask, other=0.0)
        gpre = tl.where(p > th[None, :], ga, tl.zeros_like(ga))
        tl.store(gpre_ptrs, gpre.to(gpre_ptr.dtype.element_ty), mask=mask)
        inner = th[None, :] * ga.to(tl.float32)
    else:
        tl.store(gpre_ptrs, tl.zeros((BLOCK_N, BLOCK_M), dtype=gpre_ptr.dtype.element_ty), mask=mask)
    if HAS_GRAD_L0:
        gl = tl.load(gl_ptr + rows * stride_gl, mask=mask_n, other=0.0).to(tl.float32)
        inner += gl[:, None]
    window = (tl.abs(p - th[None, :]) < half_bandwidth) & mask
    partial = tl.sum(tl.where(window, inner, tl.zeros_like(inner)), axis=0)
    tl.store(part_ptr + pid_n * stride_part + cols, partial, mask=mask_m)


# Whether the kernels above run in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported).
_INTERPRETED = not isinstance(_sparse_decode_kernel, triton.runtime.JITFunction)


def _fit(block: int, n: int) -> int:
    """``block`` shrunk to the problem size ``n`` (a power of two, never below 16)."""
    return min(block, max(16, triton.next_power_of_2(n)))


def _blocks(forced: int, rows: int, cols: int, default_rows: int, default_cols: int) -> tuple[int, int]:
    """``(BLOCK_rows, BLOCK_cols)``: ``forced > 0`` (tests) sets both, otherwise the untuned defaults, shrunk."""
    if forced > 0:
        return forced, forced
    return _fit(default_rows, rows), _fit(default_cols, cols)


def sparse_decode_forward(
    values: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int
) -> torch.Tensor:
    """``out (N, d)`` in ``values``' dtype for ``values, indices (N, k)``, ``weight (M, d)``: one launch.

    Default tiles: 32 rows × 128 columns (each step of the ``k`` loop gathers 32 weight-row segments).
    """
    n_rows, k = values.shape
    d = weight.shape[1]
    out = values.new_empty(n_rows, d)
    if n_rows == 0 or d == 0:
        return out
    block_n, block_d = _blocks(block, n_rows, d, 32, 128)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(d, block_d))
    _sparse_decode_kernel[grid](
        values,
        indices,
        weight,
        bias if bias is not None else out,
        out,
        n_rows,
        k,
        d,
        values.stride(0),
        values.stride(1),
        indices.stride(0),
        indices.stride(1),
        weight.stride(0),
        weight.stride(1),
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        INTERPRETED=_INTERPRETED,
    )
    return out


def gather_dot(
    grad_out: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor, block: int
) -> torch.Tensor:
    """``(N, k)`` in ``grad_out``'s dtype: ``⟨grad_out[n], weight[indices[n, j]]⟩``. Default: 32 rows × 128."""
    n_rows, k = indices.shape
    d = weight.shape[1]
    out = grad_out.new_empty(n_rows, k)
    if n_rows == 0:
        return out
    block_n, block_d = _blocks(block, n_rows, d, 32, 128)
    _gather_dot_kernel[(triton.cdiv(n_rows, block_n), k)](
        grad_out,
        indices,
        weight,
        out,
        n_rows,
        d,
        grad_out.stride(0),
        grad_out.stride(1),
        indices.stride(0),
        indices.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        INTERPRETED=_INTERPRETED,
    )
    return out


def jumprelu_forward(
    pre: torch.Tensor, threshold: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(acts (N, M), l0 (N,) fp32)`` for ``pre (N, M)``. Default tiles: 16 rows × 256 columns."""
    n_rows, n_cols = pre.shape
    acts = torch.empty_like(pre, memory_format=torch.contiguous_format)
    l0 = pre.new_zeros(n_rows, dtype=torch.float32)
    if n_rows == 0 or n_cols == 0:
        return acts, l0
    block_n, block_m = _blocks(block, n_rows, n_cols, 16, 256)
    _jumprelu_forward_kernel[(triton.cdiv(n_rows, block_n), triton.cdiv(n_cols, block_m))](
        pre,
        threshold,
        acts,
        l0,
        n_rows,
        n_cols,
        pre.stride(0),
        pre.stride(1),
        threshold.stride(0),
        acts.stride(0),
        acts.stride(1),
        BLOCK_N=block_n,
        BLOCK_M=block_m,
    )
    return acts, l0


def jumprelu_backward(
    grad_acts: torch.Tensor | None,
    grad_l0: torch.Tensor | None,
    pre: torch.Tensor,
    threshold: torch.Tensor,
    bandwidth: float,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_pre, d_threshold)``: one launch, then a torch sum of the ``(row blocks, M)`` fp32 partials."""
    n_rows, n_cols = pre.shape
    grad_pre = torch.empty_like(pre, memory_format=torch.contiguous_format)
    if n_rows == 0 or n_cols == 0:
        return grad_pre, torch.zeros_like(threshold)
    block_n, block_m = _blocks(block, n_rows, n_cols, 16, 256)
    num_pid_n = triton.cdiv(n_rows, block_n)
    partial = pre.new_empty(num_pid_n, n_cols, dtype=torch.float32)
    _jumprelu_backward_kernel[(num_pid_n, triton.cdiv(n_cols, block_m))](
        grad_acts if grad_acts is not None else pre,
        grad_l0 if grad_l0 is not None else pre,
        pre,
        threshold,
        grad_pre,
        partial,
        n_rows,
        n_cols,
        grad_acts.stride(0) if grad_acts is not None else 0,
        grad_acts.stride(1) if grad_acts is not None else 0,
        grad_l0.stride(0) if grad_l0 is not None else 0,
        pre.stride(0),
        pre.stride(1),
        threshold.stride(0),
        grad_pre.stride(0),
        grad_pre.stride(1),
        partial.stride(0),
        0.5 * bandwidth,
        HAS_GRAD_ACTS=grad_acts is not None,
        HAS_GRAD_L0=grad_l0 is not None,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
    )
    return grad_pre, (partial.sum(0) * (-1.0 / bandwidth)).to(threshold.dtype)
