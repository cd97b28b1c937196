"""Triton kernel for :mod:`lightning_llm.kernels.trellis_matmul`.

Kept in its own module because ``@triton.jit`` needs ``triton.language`` among the module globals and decides
between compiled and interpreted execution when the decorator runs; importing this module imports Triton.

:func:`_trellis_matmul_kernel` computes, in the incoherence-processed basis, ``y[M, m] = x[M, n] · W̃ᵀ`` with
``W̃[i, j] = σ_i · c(s(f))``, ``f = i·n + j`` the row-major flat index of the weight, ``f // tile`` its tile,
``p = f % tile`` its position and ``s`` the trellis state of step ``p // V`` rebuilt from the packed stream
(``L`` bits, read MSB first and cyclically, ending at the step's last bit; see :mod:`.trellis_decode`). Every ``BLOCK_N × BLOCK_K`` tile of ``W̃`` is decoded in registers inside the K loop
(``L`` byte loads and shifts per weight, then the code's integer instructions: no table), multiplied with the
``BLOCK_M × BLOCK_K`` activation tile by ``tl.dot`` in fp32 (``input_precision="ieee"``: no tf32) and the
per-row scales are applied once in the epilogue. Integer arithmetic is int64 with ``& (2^32 − 1)``, exactly as
:mod:`.trellis_decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M32 = 0xFFFFFFFF


@triton.jit
def _code_step(x, CODE: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr):
    if CODE == 0:  # 1MAD: a·x + b mod 2^32
        y = (x * C0 + C1) & 0xFFFFFFFF
    else:  # MUL-BAL: odd multiply mod 2^32, then xor-shift
        y = (x * C0) & 0xFFFFFFFF
        y = y ^ (y >> C1)
    return y


@triton.jit
def _code_value(x, alpha, beta, CODE: tl.constexpr):
    b0 = x & 255
    b1 = (x >> 8) & 255
    b2 = (x >> 16) & 255
    b3 = (x >> 24) & 255
    if CODE == 0:
        v = (b0 + b1 + b2 + b3 - 510).to(tl.float32) / 147.8
    else:
        v = alpha * ((b0 - b1 + b2 - b3).to(tl.float32) / 147.8) + beta
    return v


@triton.jit
def _trellis_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    out_ptr,
    M,
    N_OUT,
    N_IN,
    stride_xm,
    stride_xk,
    stride_om,
    stride_on,
    alpha,
    beta,
    CODE: tl.constexpr,
    C0: tl.constexpr,
    C1: tl.constexpr,
    L: tl.constexpr,
    KV: tl.constexpr,
    V: tl.constexpr,
    TILE: tl.constexpr,
    BYTES_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    NBITS: tl.constexpr = (TILE // V) * KV  # bits of one tile's stream
    for k0 in range(0, N_IN, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < M) & (rk[None, :] < N_IN)
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=x_mask, other=0.0)
        xt = xt.to(tl.float32)
        w_mask = (rn[:, None] < N_OUT) & (rk[None, :] < N_IN)
        f = rn[:, None].to(tl.int64) * N_IN + rk[None, :]  # [BLOCK_N, BLOCK_K] flat weight index
        tile_idx = f // TILE
        p = f % TILE
        step = p // V
        base = tile_idx * BYTES_PER_TILE
        start = (step + 1) * KV - L + NBITS  # first bit of the state, kept non-negative before the mod
        state = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int64)
        for b in tl.static_range(L):
            q = (start + b) % NBITS
            byte = tl.load(packed_ptr + base + q // 8, mask=w_mask, other=0).to(tl.int64)
            bit = (byte >> (7 - q % 8)) & 1
            state = state | (bit << (L - 1 - b))
        xs = _code_step(state, CODE, C0, C1)
        if V == 2:
            xs2 = _code_step(xs, CODE, C0, C1)
            xs = tl.where((p % V) == 1, xs2, xs)
        w = _code_value(xs, alpha, beta, CODE)
        w = tl.where(w_mask, w, 0.0)
        acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
    scales = tl.load(scales_ptr + rn, mask=rn < N_OUT, other=0.0).to(tl.float32)
    acc = acc * scales[None, :]
    out_mask = (rm[:, None] < M) & (rn[None, :] < N_OUT)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, acc, mask=out_mask)


def trellis_matmul_forward(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    n_out: int,
    code_id: int,
    c0: int,
    c1: int,
    alpha: float,
    beta: float,
    L: int,
    k: int,
    V: int,
    tile: int,
    block: int,
) -> torch.Tensor:
    """``x [M, n] fp32`` (rotated basis) → ``[M, n_out] fp32``; ``block`` > 0 forces BLOCK_N = BLOCK_K."""
    M, n_in = x.shape
    out = torch.empty(M, n_out, dtype=torch.float32, device=x.device)
    if M == 0 or n_out == 0:
        return out
    if n_in == 0:
        return out.zero_()
    block_m = 16
    block_n = block or 32
    block_k = block or 32
    grid = (triton.cdiv(M, block_m), triton.cdiv(n_out, block_n))
    _trellis_matmul_kernel[grid](
        x,
        packed,
        scales,
        out,
        M,
        n_out,
        n_in,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        float(alpha),
        float(beta),
        CODE=code_id,
        C0=c0,
        C1=c1,
        L=L,
        KV=k * V,
        V=V,
        TILE=tile,
        BYTES_PER_TILE=packed.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
