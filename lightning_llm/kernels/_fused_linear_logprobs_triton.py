"""Triton row kernels for :mod:`lightning_llm.kernels.fused_linear_logprobs`.

Kept in their own module because ``@triton.jit`` needs ``triton.language`` among the module globals (the
interpreter patches it there) and decides between compiled and interpreted execution when the decorator
runs. Importing this module therefore imports Triton; :mod:`~lightning_llm.kernels.fused_linear_logprobs`
only does so on first use of the Triton path.

The matmuls stay in PyTorch (cuBLAS); these kernels only do the per-row work on one chunk of logits:

* :func:`_row_stats_kernel` — one streaming pass over the vocabulary with an online max, producing
  ``lse``, the entropy and the target log-prob, and with ``WITH_DYNAMICS`` (a constexpr: the default
  specialisation carries no extra accumulator) the entropy-dynamics terms ``S_y`` and ``N``.
* :func:`_row_grad_kernel` — recomputes ``p`` from the saved ``lse`` and overwrites the logits in place with
  d(loss)/d(raw logits), so backward needs no second ``[chunk, V]`` buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest vocabulary block one program holds in registers per loop step. Untuned guess in the range
# Liger uses; a whole vocabulary larger than this is streamed in several steps.
_MAX_BLOCK_V = 8192


@triton.jit
def _row_stats_kernel(
    logits_ptr,
    logits_row_stride,
    targets_ptr,
    logprobs_ptr,
    entropy_ptr,
    lse_ptr,
    s_target_ptr,
    n_ptr,
    n_vocab,
    inv_temperature,
    BLOCK_V: tl.constexpr,
    WITH_DYNAMICS: tl.constexpr,
):
    """One program per row: logsumexp, entropy and target log-prob of ``z = logits * inv_temperature``.

    Streams the row in ``BLOCK_V`` blocks keeping, relative to the running max ``m``::

        s = Σ exp(z − m)            (so lse = m + log s)
        t = Σ exp(z − m) · (z − m)  (so Σ p z = m + t / s)

    which gives ``H = lse − Σ p z = log s − t / s``: two non-negative terms, no cancellation of large
    logits. When the max grows from ``m`` to ``m'`` every accumulator is rescaled by ``exp(m − m')``, and
    ``t`` is also re-centred (``z − m' = (z − m) − (m' − m)``).

    ``WITH_DYNAMICS`` (constexpr; otherwise ``s_target_ptr`` / ``n_ptr`` are never touched) adds the
    entropy-dynamics terms of arXiv 2602.03392, ``S_y = p_y (H + log p_y)`` and
    ``N = Σ p² (log p + H)``, from two more accumulators with the same rescale-then-add update (the
    rescale factor squared)::

        a = Σ exp(2(z − m))            (Σ p² = a / s²)
        b = Σ exp(2(z − m)) · (z − m)  (Σ p² log p = (b − a log s) / s²)

    (the uncentred form ``Σ p² log p = e^{2(m−lse)}(B − lse·A)`` with ``B = Σ e^{2(z−m)} z`` is the same
    quantity, but ``B`` and ``lse·A`` cancel for large logits; ``b`` is ``B`` centred on ``m``). Since
    ``log p + H = (z − m) − t/s`` (the ``log s`` terms cancel exactly), the kernel evaluates::

        N   = (b − a · t/s) / s²
        S_y = p_y · ((z_y − m) − t/s)

    i.e. ``Σ p² (z − E_p z)`` and ``p_y (z_y − E_p z)``, with no ``H + log p`` cancellation.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    cols = tl.arange(0, BLOCK_V)

    m = float("-inf")
    s = 0.0
    t = 0.0
    a = 0.0
    b = 0.0
    for start in range(0, n_vocab, BLOCK_V):
        offs = start + cols
        mask = offs < n_vocab
        z = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # On the first block m = -inf and s = t = 0: rescale is 0 and the where() keeps inf * 0 out.
        shift = tl.where(s > 0.0, m_new - m, 0.0)
        rescale = tl.exp(m - m_new)
        zc = tl.where(mask, z - m_new, 0.0)
        e = tl.where(mask, tl.exp(zc), 0.0)
        if WITH_DYNAMICS:
            e2 = e * e
            rescale2 = rescale * rescale
            b = rescale2 * (b - shift * a) + tl.sum(e2 * zc, axis=0)
            a = rescale2 * a + tl.sum(e2, axis=0)
        t = rescale * (t - shift * s) + tl.sum(e * zc, axis=0)
        s = rescale * s + tl.sum(e, axis=0)
        m = m_new

    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row)
    z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
    logprob = z_target - lse
    tl.store(logprobs_ptr + row, logprob)
    tl.store(entropy_ptr + row, log_s - t / s)
    tl.store(lse_ptr + row, lse)
    if WITH_DYNAMICS:
        mean_zc = t / s  # E_p[z] − m
        tl.store(s_target_ptr + row, tl.exp(logprob) * ((z_target - m) - mean_zc))
        tl.store(n_ptr + row, (b - a * mean_zc) / (s * s))


@triton.jit
def _row_grad_kernel(
    logits_ptr,
    logits_row_stride,
    targets_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logprobs_ptr,
    grad_entropy_ptr,
    n_vocab,
    inv_temperature,
    BLOCK_V: tl.constexpr,
):
    """One program per row: overwrite the raw logits with d(loss)/d(raw logits), in the logits' dtype.

    With ``z = logits · inv_temperature``, ``log p = z − lse`` and upstream grads ``g_lp``, ``g_H``::

        dz_j = g_lp · (1[j = y] − p_j) − g_H · p_j (log p_j + H)

    and the stored value is ``dz · inv_temperature`` (chain rule through the temperature).
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    cols = tl.arange(0, BLOCK_V)

    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_lp = tl.load(grad_logprobs_ptr + row)
    g_h = tl.load(grad_entropy_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, n_vocab, BLOCK_V):
        offs = start + cols
        mask = offs < n_vocab
        z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_temperature
        log_p = z - lse
        p = tl.exp(log_p)
        dz = -p * (g_lp + g_h * (log_p + entropy))
        dz = tl.where(offs == target, dz + g_lp, dz)
        tl.store(row_ptr + offs, (dz * inv_temperature).to(logits_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_vocab: int, block_v: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``n_vocab``; ``block_v > 0`` overrides the block (tests use it)."""
    block = block_v if block_v > 0 else min(triton.next_power_of_2(n_vocab), _MAX_BLOCK_V)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return block, num_warps


def row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    lse: torch.Tensor,
    s_target: torch.Tensor | None = None,
    n: torch.Tensor | None = None,
    *,
    block_v: int,
) -> None:
    """Fill ``logprobs``, ``entropy``, ``lse`` (fp32, ``[rows]``) from one contiguous ``[rows, V]`` chunk.

    With ``s_target`` and ``n`` (fp32 ``[rows]``) the dynamics specialisation also fills those; without,
    the default specialisation runs and ``lse`` stands in for the two unused pointers.
    """
    rows, n_vocab = logits.shape
    block, num_warps = _launch_config(n_vocab, block_v)
    with_dynamics = s_target is not None and n is not None
    _row_stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        logprobs,
        entropy,
        lse,
        s_target if with_dynamics else lse,
        n if with_dynamics else lse,
        n_vocab,
        inv_temperature,
        BLOCK_V=block,
        WITH_DYNAMICS=with_dynamics,
        num_warps=num_warps,
    )


def row_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    inv_temperature: float,
    block_v: int,
) -> None:
    """Overwrite the contiguous ``[rows, V]`` chunk ``logits`` with the gradient w.r.t. those logits."""
    rows, n_vocab = logits.shape
    block, num_warps = _launch_config(n_vocab, block_v)
    _row_grad_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        lse,
        entropy,
        grad_logprobs,
        grad_entropy,
        n_vocab,
        inv_temperature,
        BLOCK_V=block,
        num_warps=num_warps,
    )
