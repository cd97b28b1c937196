"""Triton kernel for :mod:`lightning_llm.kernels.lora_linear`.

Kept in its own module because ``@triton.jit`` needs ``triton.language`` among the module globals (the
interpreter patches it there) and decides between compiled and interpreted execution when the decorator
runs. Importing this module therefore imports Triton; :mod:`~lightning_llm.kernels.lora_linear` only does so
on first use of the Triton path.

:func:`_lora_linear_kernel` computes, for ``X (M, K)``, ``Wmat (K, N)``, ``P (K, R)``, ``Q (N, R)``::

    OUT = X @ Wmat + s·((X @ P) ⊙ c) @ Qᵀ (+ bias)        T = X @ P   (fp32)

Forward is ``X = x``, ``Wmat = Wᵀ``, ``P = Aᵀ``, ``Q = B`` (so ``T = t``); backward's ``dx`` is ``X = dy``,
``Wmat = W``, ``P = B``, ``Q = Aᵀ`` (so ``T = u = dy B``). Every operand is passed with its strides, so
these transposes are free views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Grouped program order (as in Triton's matmul tutorial): consecutive programs cover GROUP_M row tiles of one
# column tile before moving on, so the Wmat and Q tiles they share are still in L2.
_GROUP_M = 8


@triton.jit
def _downcast(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``v.to(dtype)`` for fp32 ``v``, rounding to nearest even, also under the interpreter.

    Compiled kernels round fp32 → bf16 to nearest even; the interpreter truncates. There the value is first
    rounded to nearest even in the fp32 bit pattern (add ``0x7FFF`` plus the lowest kept bit, clear the low
    16 bits), after which the truncating cast is exact.
    """
    if INTERPRETED:  # nested static ifs: compiled kernels never see the body
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _lora_linear_kernel(
    x_ptr,
    w_ptr,
    p_ptr,
    q_ptr,
    c_ptr,
    bias_ptr,
    out_ptr,
    t_ptr,
    M,
    N,
    K,
    R,
    num_pid_n,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_pk,
    stride_pr,
    stride_qn,
    stride_qr,
    stride_c,
    stride_bias,
    stride_om,
    stride_on,
    stride_tm,
    stride_tr,
    scale,
    HAS_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per ``BLOCK_M × BLOCK_N`` tile of ``OUT``; the ``pid_n == 0`` programs also store ``T``.

    The loop over ``K`` loads each ``X`` tile once and accumulates both ``acc += X @ Wmat`` and
    ``t_acc += X @ P`` in fp32 (``BLOCK_R`` ≥ ``R``, padded columns masked to zero). The epilogue rounds
    ``s·(t_acc ⊙ c)`` to the operand dtype and adds its product with the ``Qᵀ`` tile, then the bias, and
    stores ``OUT`` in its dtype. ``num_pid_n`` is at least 1 so that ``T`` is produced even when ``N = 0``.

    ``INTERPRETED`` is true only under ``TRITON_INTERPRET=1``, whose ``tl.dot`` gives garbage for bf16
    operands: the operands are then upcast to fp32 (exact for 16-bit values, so the results match a GPU's
    16-bit dot with fp32 accumulation), and bf16 downcasts round as on a GPU (:func:`_downcast`).
    ``INPUT_PRECISION`` applies to fp32 operands (``"tf32"`` or ``"ieee"``).
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_r = offs_r < R
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    ks = offs_k.to(tl.int64)

    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    p_ptrs = p_ptr + ks[:, None] * stride_pk + offs_r[None, :] * stride_pr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        p = tl.load(p_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if INTERPRETED:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
            p = p.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        t_acc = tl.dot(x, p, t_acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
        p_ptrs += BLOCK_K * stride_pk

    if HAS_C:
        c = tl.load(c_ptr + offs_r * stride_c, mask=mask_r, other=0.0).to(tl.float32)
        factor = t_acc * (c * scale)[None, :]
    else:
        factor = t_acc * scale
    qt_ptrs = q_ptr + offs_r[:, None] * stride_qr + cols[None, :] * stride_qn
    qt = tl.load(qt_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
    factor = _downcast(factor, qt.dtype, INTERPRETED)
    if INTERPRETED:
        factor = factor.to(tl.float32)
        qt = qt.to(tl.float32)
    acc = tl.dot(factor, qt, acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]

    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(
        out_ptrs,
        _downcast(acc, out_ptr.dtype.element_ty, INTERPRETED),
        mask=mask_m[:, None] & mask_n[None, :],
    )
    if pid_n == 0:
        t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr
        tl.store(t_ptrs, t_acc, mask=mask_m[:, None] & mask_r[None, :])


# Whether the kernel above runs in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported).
_INTERPRETED = not isinstance(_lora_linear_kernel, triton.runtime.JITFunction)


def _launch_config(
    n_rows: int, n_cols: int, n_red: int, rank: int, dtype: torch.dtype, block: int
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, num_warps)``; ``block > 0`` forces M, N and K blocks (tests).

    Untuned defaults: 64 × 128 output tiles (32 rows once the rank block exceeds 128, to bound the
    ``BLOCK_M × BLOCK_R`` accumulator), a 64-deep reduction step for 16-bit inputs and 32 for fp32 or ranks
    above 64, each shrunk to the problem (never below 16, ``tl.dot``'s minimum).
    """
    block_r = max(16, triton.next_power_of_2(rank))
    if block > 0:
        return block, block, block, block_r, 4
    block_m = 64 if block_r <= 128 else 32
    block_k = 64 if dtype != torch.float32 and block_r <= 64 else 32

    def fit(b: int, n: int) -> int:
        return min(b, max(16, triton.next_power_of_2(n)))

    return fit(block_m, n_rows), fit(128, n_cols), fit(block_k, n_red), block_r, 8 if block_r > 64 else 4


def lora_linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    column_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, t)`` for ``x (M, in)``, ``weight (out, in)``, ``A (r, in)``, ``B (out, r)``: one kernel launch.

    Inputs may be any strided views (backward passes ``weight.T``, ``B.T``, ``A.T``); ``y`` is a new
    contiguous ``(M, out)`` tensor in ``x``'s dtype and ``t = x Aᵀ`` a new contiguous fp32 ``(M, r)``.
    """
    n_rows, n_red = x.shape
    n_cols, rank = weight.shape[0], A.shape[0]
    y = x.new_empty(n_rows, n_cols)
    t = x.new_empty(n_rows, rank, dtype=torch.float32)
    if n_rows == 0:
        return y, t
    block_m, block_n, block_k, block_r, num_warps = _launch_config(
        n_rows, n_cols, n_red, rank, x.dtype, block
    )
    num_pid_n = max(1, triton.cdiv(n_cols, block_n))
    # fp32 operands use TF32 exactly when torch's own CUDA matmuls would; 16-bit operands ignore it.
    precision = "tf32" if x.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"
    grid = (triton.cdiv(n_rows, block_m) * num_pid_n,)
    _lora_linear_kernel[grid](
        x,
        weight,
        A,
        B,
        column_scale if column_scale is not None else t,
        bias if bias is not None else t,
        y,
        t,
        n_rows,
        n_cols,
        n_red,
        rank,
        num_pid_n,
        x.stride(0),
        x.stride(1),
        weight.stride(1),  # Wmat = weightᵀ: (k, n) is weight[n, k]
        weight.stride(0),
        A.stride(1),  # P = Aᵀ: (k, r) is A[r, k]
        A.stride(0),
        B.stride(0),  # Q = B: (n, r)
        B.stride(1),
        column_scale.stride(0) if column_scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        y.stride(0),
        y.stride(1),
        t.stride(0),
        t.stride(1),
        scale,
        HAS_C=column_scale is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=block_r,
        GROUP_M=_GROUP_M,
        INPUT_PRECISION=precision,
        INTERPRETED=_INTERPRETED,
        num_warps=num_warps,
    )
    return y, t
