"""Triton kernel for :mod:`lightning_llm.kernels.budgeted_attention`.

Kept in its own module because ``@triton.jit`` needs ``triton.language`` among the module globals (the
interpreter patches it there) and decides between compiled and interpreted execution when the decorator
runs. Importing this module therefore imports Triton; :mod:`~lightning_llm.kernels.budgeted_attention` only
does so on first use of the Triton path.

:func:`_budgeted_attention_kernel` computes, per ``(b, h)`` with ``j = h // G`` and ``n = lengths[b, j]``::

    attn = softmax_{s < n}(scale · q[b, h] · k[b, j, s]) · v[b, j, :n]
    r    = (φ(q[b, h]) S_mem[b, h]) / (φ(q[b, h]) · z[b, h] + ε)                          (if HAS_MEMORY)
    out  = attn + gate[b, h] · r                                                         (residual)
    out  = attn + σ(log m − log Z) · (r − attn),  m = gate[b, h] · φ(q[b, h]) · z[b, h]   (MEMORY_SLOT)

with ``log Z = running max + log running sum`` of the online softmax.

It uses no ``tl.dot`` (a decode step is one matrix-vector product per head): products and sums are fp32
FMAs and reductions, so the interpreter's bf16 ``tl.dot`` problem does not arise; the 16-bit output is
rounded once, to nearest even also under the interpreter (:func:`_downcast`). Every operand is passed with
its strides, so views (an expanded ``(H,)`` gate, a slice of a larger cache) need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_llm.kernels._lora_linear_triton import _downcast

# Elements of one BLOCK_S × BLOCK_D (or BLOCK_F × BLOCK_D) fp32 tile held in registers by default.
_TILE_ELEMENTS = 4096


@triton.jit
def _budgeted_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    mem_ptr,
    norm_ptr,
    gate_ptr,
    out_ptr,
    H,
    G,
    S,
    D,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_mh,
    stride_mf,
    stride_md,
    stride_nb,
    stride_nh,
    stride_nf,
    stride_gb,
    stride_gh,
    stride_ob,
    stride_oh,
    stride_od,
    scale,
    eps,
    HAS_MEMORY: tl.constexpr,
    HAS_GATE: tl.constexpr,
    MEMORY_SLOT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One program per ``(batch, query head)``: online softmax over the valid slots, then the readout.

    The loop runs over ``BLOCK_S`` tiles of the head's first ``n = clamp(lengths[b, j], 0, S)`` slots only
    (tiles past ``n`` are never loaded); each iteration has at least one valid slot, so the running max
    ``m`` is finite after it and ``exp(m_old − m)`` never sees ``−∞ − (−∞)``. ``n = 0`` leaves the sum ``l``
    at 0, and the attention term is then 0 (divided by 1). The epilogue adds the memory readout, reading
    ``S_mem`` and ``z`` in ``BLOCK_F × BLOCK_D`` tiles (added, or with ``MEMORY_SLOT`` weighed against the
    attended mass: weight 1 when ``n = 0``, 0 when ``m <= 0``), and stores the result once in ``out``'s dtype.
    """
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    j = h // G
    n = tl.load(len_ptr + b * stride_lb + j * stride_lh).to(tl.int32)
    n = tl.minimum(tl.maximum(n, 0), S)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q_base = q_ptr + b * stride_qb + h * stride_qh
    q = tl.load(q_base + offs_d * stride_qd, mask=mask_d, other=0.0).to(tl.float32)
    q_scaled = q * scale

    k_base = k_ptr + b * stride_kb + j * stride_kh
    v_base = v_ptr + b * stride_vb + j * stride_vh
    offs_s = tl.arange(0, BLOCK_S)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s0 in range(0, n, BLOCK_S):
        slots = s0 + offs_s
        mask_s = slots < n
        tile_mask = mask_s[:, None] & mask_d[None, :]
        kt = tl.load(
            k_base + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=tile_mask, other=0.0
        ).to(tl.float32)
        scores = tl.sum(kt * q_scaled[None, :], axis=1)
        scores = tl.where(mask_s, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)  # 0 on masked slots
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vt = tl.load(
            v_base + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=tile_mask, other=0.0
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)

    if HAS_MEMORY:
        mem_base = mem_ptr + b * stride_mb + h * stride_mh
        norm_base = norm_ptr + b * stride_nb + h * stride_nh
        offs_f = tl.arange(0, BLOCK_F)
        num = tl.zeros((BLOCK_D,), dtype=tl.float32)
        den = 0.0
        for f0 in range(0, D, BLOCK_F):
            feats = f0 + offs_f
            mask_f = feats < D
            qf = tl.load(q_base + feats * stride_qd, mask=mask_f, other=0.0).to(tl.float32)
            phi_q = tl.where(qf > 0, qf + 1.0, tl.exp(qf))  # elu(x) + 1
            phi_q = tl.where(mask_f, phi_q, 0.0)
            st = tl.load(
                mem_base + feats[:, None] * stride_mf + offs_d[None, :] * stride_md,
                mask=mask_f[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            num += tl.sum(phi_q[:, None] * st, axis=0)
            z = tl.load(norm_base + feats * stride_nf, mask=mask_f, other=0.0).to(tl.float32)
            den += tl.sum(phi_q * z, axis=0)
        readout = num / (den + eps)
        if MEMORY_SLOT:
            mass = den  # φ(q)·z, the estimated evicted share of Σ exp(logit)
            if HAS_GATE:
                mass = mass * tl.load(gate_ptr + b * stride_gb + h * stride_gh).to(tl.float32)
            # weight = σ(log m − log Z), with log Z = m_i + log l_i; n = 0 (l_i = 0) means Z = 0, weight 1.
            # Written without log(0) or an overflowing exp: σ(d) = 1 / (1 + e) or e / (1 + e), e = exp(−|d|).
            tiny = 1.1754943508222875e-38
            d = tl.log(tl.maximum(mass, tiny)) - (m_i + tl.log(tl.maximum(l_i, tiny)))
            e = tl.exp(-tl.abs(d))
            weight = tl.where(d >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
            weight = tl.where(l_i > 0, weight, 1.0)
            weight = tl.where(mass > 0, weight, 0.0)
            out = out + weight * (readout - out)
        else:
            if HAS_GATE:
                readout = readout * tl.load(gate_ptr + b * stride_gb + h * stride_gh).to(tl.float32)
            out = out + readout

    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, _downcast(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask_d)


# Whether the kernel above runs in Triton's interpreter (TRITON_INTERPRET=1 when this module was imported).
_INTERPRETED = not isinstance(_budgeted_attention_kernel, triton.runtime.JITFunction)


def _launch_config(capacity: int, head_dim: int, block: int) -> tuple[int, int, int, int]:
    """``(BLOCK_S, BLOCK_F, BLOCK_D, num_warps)``; ``block > 0`` forces the slot and feature blocks (tests).

    ``BLOCK_D`` is ``D`` padded to a power of two. Untuned defaults: slot / feature tiles of about
    :data:`_TILE_ELEMENTS` fp32 values (64 slots at ``D ≤ 64``, 16 at ``D = 256``), shrunk to the problem.
    """
    block_d = max(2, triton.next_power_of_2(head_dim))
    num_warps = 4 if block_d <= 128 else 8
    if block > 0:
        return block, block, block_d, num_warps
    tile = max(2, min(64, _TILE_ELEMENTS // block_d))
    block_s = min(tile, max(2, triton.next_power_of_2(capacity)))
    block_f = min(tile, block_d)
    return block_s, block_f, block_d, num_warps


def budgeted_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    memory_state: torch.Tensor | None,
    memory_norm: torch.Tensor | None,
    gate: torch.Tensor | None,
    scale: float,
    eps: float,
    block: int,
    memory_mode: str = "residual",
) -> torch.Tensor:
    """``out (B, H, D)`` in ``q``'s dtype: one kernel launch over ``B·H`` programs; ``eps`` is the readout's ``ε``.

    Inputs may be any strided views; a ``(H,)`` gate is broadcast over the batch through a zero stride.
    ``lengths`` is clamped to ``[0, S]`` inside the kernel (not checked: that would cost a host sync).
    """
    n_batch, n_heads, head_dim = q.shape
    n_kv, capacity = k.shape[1], k.shape[2]
    out = torch.empty(n_batch, n_heads, head_dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if gate is not None and gate.dim() == 1:
        gate = gate.expand(n_batch, n_heads)
    has_memory = memory_state is not None and memory_norm is not None
    mem = memory_state if memory_state is not None else out
    norm = memory_norm if memory_norm is not None else out
    gate_t = gate if gate is not None else out
    block_s, block_f, block_d, num_warps = _launch_config(capacity, head_dim, block)
    _budgeted_attention_kernel[(n_batch * n_heads,)](
        q,
        k,
        v,
        lengths,
        mem,
        norm,
        gate_t,
        out,
        n_heads,
        n_heads // n_kv,
        capacity,
        head_dim,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *lengths.stride(),
        *(memory_state.stride() if memory_state is not None else (0, 0, 0, 0)),
        *(memory_norm.stride() if memory_norm is not None else (0, 0, 0)),
        *(gate.stride() if gate is not None else (0, 0)),
        *out.stride(),
        scale,
        eps,
        HAS_MEMORY=has_memory,
        HAS_GATE=has_memory and gate is not None,
        MEMORY_SLOT=has_memory and memory_mode == "softmax",
        BLOCK_S=block_s,
        BLOCK_F=block_f,
        BLOCK_D=block_d,
        INTERPRETED=_INTERPRETED,
        num_warps=num_warps,
    )
    return out
