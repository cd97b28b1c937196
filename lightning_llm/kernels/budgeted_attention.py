r"""One decode step of attention over a budgeted (evicted) KV cache, plus an optional latent-memory readout.

docs/methods.md §11 (eviction-aware inference): the KV cache keeps at most ``S`` tokens per (batch, kv head) (sinks,
recent tokens and the indexer's top-scored ones), and the evicted tokens are folded into a linear-attention
style latent state whose gated readout is added to the attention output. Shapes::

    q      : (B, H, D)        the new token's queries, H query heads
    k, v   : (B, Hkv, S, D)   the kept keys / values; S is the budget capacity, H % Hkv == 0
    lengths: (B, Hkv) int     valid slots per (batch, kv head); slots s >= lengths[b, j] are ignored
    S_mem  : (B, H, F, D)     memory_state, S_mem = Σ_{evicted t} φ(k_t)ᵀ v_t     (optional)
    z      : (B, H, F)        memory_norm,  z = Σ_{evicted t} φ(k_t)                (with memory_state)
    gate   : (B, H) or (H,)   in [0, 1], callers pass σ(learned logit)             (optional, default 1)
    out    : (B, H, D)

With ``j(h) = h // (H / Hkv)`` the kv head that query head ``h`` reads (grouped-query attention),
``n = lengths[b, j(h)]`` and ``scale`` (default ``1/√D``)::

    a_s  = softmax_{s < n}(scale · q[b, h] · k[b, j(h), s])                 (over the valid slots only)
    attn = Σ_{s < n} a_s · v[b, j(h), s]                                    (0 when n = 0)
    r    = (φ(q[b, h]) S_mem[b, h]) / (φ(q[b, h]) · z[b, h] + ε)          φ(x) = elu(x) + 1,  ε = 1e-6

and, by ``memory_mode``,

    "residual":  out = attn + gate[b, h] · r
    "softmax":   out = (Z · attn + m · r) / (Z + m) = attn + σ(log m − log Z) · (r − attn),
                 Z = Σ_{s < n} exp(scale · q[b, h] · k[b, j(h), s]),   m = gate[b, h] · φ(q[b, h]) · z[b, h]

In ``"softmax"`` mode the memory is one more slot of the attention softmax: ``φ(q)·z`` is the
linear-attention estimate of the evicted keys' share ``Σ exp(logit)`` and the gate scales that mass (callers
pass ``σ(gate logit) · e^c`` with a learned per-head scale ``c``, as
:class:`~lightning_llm.eviction.LatentMemory` does in that mode), so a confident match among the kept keys
(large ``Z``) outweighs the blurred readout; ``m = 0`` gives exactly ``attn``, ``n = 0`` with ``m > 0``
exactly ``r``.

This is our reading of the paper (arXiv 2605.25475, no public code): docs/methods.md §11 marks all its exact forms as
unverified, in particular the feature map φ (:func:`phi`, the positive map of linear-transformer papers),
``ε`` (:data:`MEMORY_EPS`) and where the gate enters. Because φ is elementwise, the feature dim ``F`` equals
the head dim ``D``. Conventions:

* ``memory_state=None``: the readout term is absent, so ``out`` is exactly the budgeted attention; so it
  is with ``gate = 0`` (``attn + 0``, or a zero-mass slot). Nothing evicted (``n = S`` for all heads, no memory) is exactly
  full softmax attention over the cache.
* ``lengths[b, j] = 0``: softmax over no slots contributes 0 (not NaN), so those heads return only the
  memory readout (or zeros without memory); in ``"softmax"`` mode the readout with weight 1 (0 if ``m = 0``).
* The gate is not range-checked (it would cost a device sync); in ``"residual"`` mode any real value scales
  the readout, in ``"softmax"`` mode a mass ``m <= 0`` means an empty slot (weight 0).

What the Triton kernel (:mod:`._budgeted_attention_triton`) fuses: one program per ``(batch, query head)``
runs a flash-decoding style online softmax over the head's ``n`` valid slots in ``BLOCK_S`` tiles (running
max, running sum and a ``D``-vector accumulator in fp32; tiles past ``n`` are never loaded, so a short
budget also costs less bandwidth), then in its epilogue reads ``φ(q)``, ``S_mem`` and ``z`` in ``F`` tiles
for the memory readout, combines it with the attention (added, or weighed against ``log Z = max + log sum``
that the online softmax already holds) and stores ``out`` once. Why one program per query head rather than
one per kv head holding the group: a decode step is a matrix-vector product per head (no reuse inside a
head to feed tensor cores), so the kernel uses fp32 FMAs and reductions instead of ``tl.dot`` (no padding of
the group or ``D`` to 16, exact fp32 products for every dtype); the ``H / Hkv`` programs that share a kv head
are adjacent, so all but the first read of a K/V tile are served from L2; and it launches ``B·H`` programs
rather than ``B·Hkv``. Not done: splitting long caches over several programs per head with a second
reduction pass (flash-decoding's split-K), which matters when ``B·H`` is far below the SM count.

Precision: every path computes in fp32 (fp64 for fp64 inputs, reference only) from the input values and
rounds once to ``q``'s dtype; the kernel and the reference differ only in summation order and ``exp``.
``memory_state``, ``memory_norm`` and ``gate`` may have any floating dtype (a long-lived latent state is
typically kept in fp32 next to a bf16 cache); they are read as fp32.

``lengths`` must lie in ``[0, S]``: the reference checks this (one min/max pass, a host sync on CUDA) and
raises a ValueError; the Triton path clamps to ``[0, S]`` instead (checking would cost a sync per step).

Inference only: the op has no autograd formula (backward through it raises). Dispatch follows
:mod:`._dispatch`: CUDA tensors of a kernel dtype with Triton importable run the kernel, everything else (CPU,
no Triton, ``LIGHTNING_LLM_DISABLE_TRITON=1``, fp64) runs :func:`_torch_budgeted_attention`, the
plain-PyTorch spec. The op is the ``torch.library`` custom op ``lightning_llm::budgeted_attention`` with a
fake, so it is opaque to, and works under, ``torch.compile``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm.kernels._common import check_dtypes, check_hooks, check_same_device
from lightning_llm.kernels._dispatch import resolve_backend

__all__ = ["MAX_TRITON_HEAD_DIM", "MEMORY_EPS", "MEMORY_MODES", "budgeted_attention", "memory_readout", "phi"]

#: ``ε`` in the readout's denominator ``φ(q)·z + ε`` (our choice; the paper's value is unverified). The
#: Triton kernel receives it from here.
MEMORY_EPS = 1e-6

#: Largest head dim the Triton kernel takes (one ``BLOCK_S × D`` tile of K or V in registers).
MAX_TRITON_HEAD_DIM = 256

#: How the readout enters: ``"residual"`` (added, gated) or ``"softmax"`` (one more softmax slot of mass
#: ``gate · φ(q)·z``); see the module docstring.
MEMORY_MODES = ("residual", "softmax")


def phi(x: Tensor) -> Tensor:
    """The memory's feature map ``φ(x) = elu(x) + 1`` (positive, elementwise), in ``x``'s dtype.

    Callers building ``memory_state`` / ``memory_norm`` from evicted keys use this same map; the Triton
    kernel evaluates it as ``x + 1`` for ``x > 0`` and ``exp(x)`` otherwise.
    """
    return F.elu(x) + 1


def memory_readout(queries: Tensor, state: Tensor, norm: Tensor) -> Tensor:
    """The memory term ``φ(q) S / (φ(q)·z + ε)`` ``[B, Hq, T, D]`` for queries ``[B, Hq, T, D]`` and a state
    ``S`` ``[B, Hs, D, D]``, ``z`` ``[B, Hs, D]`` with ``Hq % Hs == 0`` (query head ``h`` reads state ``h // (Hq / Hs)``:
    ``Hs = Hq`` for this kernel's per-query-head state, ``Hs = Hkv`` for a state kept per KV head), without the
    gate; computed in fp32 (fp64 for fp64 queries). The kernel's reference path and
    :class:`~lightning_llm.eviction.LatentMemory` both use it.
    """
    acc = torch.promote_types(queries.dtype, torch.float32)
    b, hq, t, d = queries.shape
    hs = state.shape[1]
    fq = phi(queries.to(acc)).reshape(b, hs, hq // hs, t, d)
    num = torch.einsum("bhgtf,bhfd->bhgtd", fq, state.to(acc))
    den = torch.einsum("bhgtf,bhf->bhgt", fq, norm.to(acc))[..., None] + MEMORY_EPS
    return (num / den).reshape(b, hq, t, d)


def budgeted_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    scale: float | None = None,
    memory_state: Tensor | None = None,
    memory_norm: Tensor | None = None,
    gate: Tensor | None = None,
    memory_mode: str = "residual",
) -> Tensor:
    r"""One decode step of attention over a budgeted KV cache plus the latent-memory readout.

    ``"residual"``: ``out = attn + gate·r``; ``"softmax"``: ``out = (Z·attn + m·r)/(Z + m)`` with
    ``attn = softmax(scale·q·k_s over valid s)·v``, ``r = (φ(q) S_mem) / (φ(q)·z + ε)``, ``Z = Σ_s exp(scale·q·k_s)``,
    ``m = gate·φ(q)·z``, ``φ = elu + 1`` and ``ε = 1e-6`` (our reading of docs/methods.md §11; see the module docstring
    for the equations, conventions and what the Triton kernel fuses). Inference only: no autograd.

    Args:
        q: ``(B, H, D)`` queries of the new token, fp32/bf16/fp16 (fp64 on the reference path).
        k: ``(B, Hkv, S, D)`` kept keys, same dtype and device as ``q``; ``H`` must be a multiple of ``Hkv``
            (query head ``h`` reads kv head ``h // (H // Hkv)``).
        v: ``(B, Hkv, S, D)`` kept values, same dtype.
        lengths: ``(B, Hkv)`` integer count of valid slots per (batch, kv head), each in ``[0, S]``; slots at
            or past it are ignored (per-head budgets may differ).
        scale: softmax scale, a finite Python number; default ``1/√D``.
        memory_state: optional ``(B, H, F, D)`` latent state ``Σ φ(k)ᵀ v`` over evicted tokens (``F = D``),
            any floating dtype. None: no readout term.
        memory_norm: ``(B, H, F)`` normaliser ``Σ φ(k)``; required exactly when ``memory_state`` is given.
        gate: optional ``(B, H)`` or ``(H,)`` (only with ``memory_state``); None means 1. ``"residual"``: the
            readout gate in ``[0, 1]``; ``"softmax"``: the factor on the estimated mass ``φ(q)·z``, ``>= 0``.
        memory_mode: ``"residual"`` or ``"softmax"`` (how the readout enters; see above).

    Returns:
        ``(B, H, D)`` in ``q``'s dtype, computed in fp32 and rounded once.

    Raises:
        ValueError: inconsistent shapes (the message names them), devices, ``lengths`` outside ``[0, S]``
            (reference path), or a non-finite ``scale``.
        TypeError: unsupported or mismatched dtypes.
    """
    return _budgeted_attention(
        q,
        k,
        v,
        lengths,
        scale=scale,
        memory_state=memory_state,
        memory_norm=memory_norm,
        gate=gate,
        memory_mode=memory_mode,
    )


def _budgeted_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    *,
    scale: float | None = None,
    memory_state: Tensor | None = None,
    memory_norm: Tensor | None = None,
    gate: Tensor | None = None,
    memory_mode: str = "residual",
    _backend: str = "auto",
    _block: int | None = None,
) -> Tensor:
    """:func:`budgeted_attention` with test hooks.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block`` forces the Triton slot and feature blocks (a power of two ≥ 2) so tests can exercise several
    tiles and ragged edges on small shapes.
    """
    _validate(q, k, v, lengths, scale, memory_state, memory_norm, gate, _backend, _block)
    if memory_mode not in MEMORY_MODES:
        raise ValueError(f"memory_mode must be one of {MEMORY_MODES}, got {memory_mode!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.lightning_llm.budgeted_attention(
        q, k, v, lengths, memory_state, memory_norm, gate, float(scale), memory_mode, _backend, _block or 0
    )


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _validate(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    scale: float | None,
    memory_state: Tensor | None,
    memory_norm: Tensor | None,
    gate: Tensor | None,
    backend: str,
    block: int | None,
) -> None:
    """Static checks (shapes, dtypes, devices, scalars), done before the op so they run under compile too."""
    if q.dim() != 3:
        raise ValueError(f"q must have shape (B, H, D), got {_shape(q)}")
    if k.dim() != 4:
        raise ValueError(f"k must have shape (B, Hkv, S, D), got {_shape(k)}")
    n_batch, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    if k.shape[0] != n_batch or k.shape[3] != head_dim:
        raise ValueError(f"q is {_shape(q)} but k is {_shape(k)} (expected ({n_batch}, Hkv, S, {head_dim}))")
    if head_dim < 1:
        raise ValueError(f"head dim D must be >= 1, got q {_shape(q)}")
    if n_kv < 1 or n_heads % n_kv:
        raise ValueError(
            f"query heads H = {n_heads} (q {_shape(q)}) must be a multiple of kv heads Hkv = {n_kv} "
            f"(k {_shape(k)})"
        )
    if _shape(v) != _shape(k):
        raise ValueError(f"k is {_shape(k)} but v is {_shape(v)} (expected the same shape)")
    if _shape(lengths) != (n_batch, n_kv):
        raise ValueError(
            f"lengths must have shape (B, Hkv) = ({n_batch}, {n_kv}) for k {_shape(k)}, got {_shape(lengths)}"
        )
    if (memory_state is None) != (memory_norm is None):
        raise ValueError("memory_state and memory_norm must be given together (or both None)")
    if memory_state is not None and memory_norm is not None:
        if memory_state.dim() != 4 or _shape(memory_state)[:2] != (n_batch, n_heads):
            raise ValueError(
                f"memory_state must have shape (B, H, F, D) = ({n_batch}, {n_heads}, F, {head_dim}) "
                f"for q {_shape(q)}, got {_shape(memory_state)}"
            )
        if memory_state.shape[2:] != (head_dim, head_dim):
            raise ValueError(
                f"memory_state is {_shape(memory_state)} but φ = elu + 1 is elementwise, so its feature dim "
                f"F must equal D: expected ({n_batch}, {n_heads}, {head_dim}, {head_dim})"
            )
        if _shape(memory_norm) != (n_batch, n_heads, head_dim):
            raise ValueError(
                f"memory_norm must have shape (B, H, F) = ({n_batch}, {n_heads}, {head_dim}) for "
                f"memory_state {_shape(memory_state)}, got {_shape(memory_norm)}"
            )
    if gate is not None:
        if memory_state is None:
            raise ValueError("gate scales the memory readout, so it needs memory_state (got None)")
        if _shape(gate) not in ((n_batch, n_heads), (n_heads,)):
            raise ValueError(
                f"gate must have shape (B, H) = ({n_batch}, {n_heads}) or (H,) = ({n_heads},) for "
                f"q {_shape(q)}, got {_shape(gate)}"
            )
    check_dtypes("q", {"q": q, "k": k, "v": v})
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths must be an integer tensor, got {lengths.dtype}")
    for name, t in (("memory_state", memory_state), ("memory_norm", memory_norm), ("gate", gate)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    check_same_device((q, k, v, lengths, memory_state, memory_norm, gate))
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite Python number or None, got {scale!r}")
    check_hooks(backend, block, min_block=2)


# --------------------------------------------------------------------------------------------------
# Reference (the spec of the Triton kernel) and dispatch
# --------------------------------------------------------------------------------------------------


def _check_lengths(lengths: Tensor, capacity: int) -> None:
    """ValueError unless ``0 <= lengths <= capacity``: one min/max pass (a host sync on CUDA)."""
    if lengths.numel() == 0:
        return
    lo, hi = lengths.min().item(), lengths.max().item()
    if lo < 0 or hi > capacity:
        raise ValueError(f"lengths must lie in [0, S] = [0, {capacity}], got values in [{lo}, {hi}]")


def _torch_budgeted_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    memory_state: Tensor | None,
    memory_norm: Tensor | None,
    gate: Tensor | None,
    scale: float,
    memory_mode: str = "residual",
) -> Tensor:
    """The plain-PyTorch spec: masked softmax attention plus the readout, in fp32 (fp64 for fp64).

    Works for any ``S`` (masking, no per-head slicing); a head with no valid slot gets zero attention
    (its max is replaced by 0 so no ``-inf - -inf`` appears, and its zero sum by 1). In ``"softmax"`` mode
    the slot weight is ``σ(log m − log Z)`` with ``log Z = max + log sum`` (``−∞`` for no valid slot, weight 1)
    and weight 0 where ``m <= 0``.
    """
    n_batch, n_heads, head_dim = q.shape
    n_kv, capacity = k.shape[1], k.shape[2]
    _check_lengths(lengths, capacity)
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).reshape(n_batch, n_kv, n_heads // n_kv, head_dim)  # (B, Hkv, G, D)
    scores = torch.einsum("bjgd,bjsd->bjgs", qg, k.to(acc)) * scale
    valid = torch.arange(capacity, device=q.device) < lengths[..., None]  # (B, Hkv, S)
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    # amax rejects an empty dim (S = 0, an empty cache); the max is then irrelevant.
    row_max = scores.amax(-1, keepdim=True) if capacity else scores.new_zeros(*scores.shape[:-1], 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # exactly 0 on masked slots
    denom = p.sum(-1, keepdim=True)
    attn = torch.einsum("bjgs,bjsd->bjgd", p, v.to(acc)) / torch.where(denom > 0, denom, 1.0)
    out = attn.reshape(n_batch, n_heads, head_dim)
    if memory_state is not None and memory_norm is not None:
        readout = memory_readout(q[:, :, None], memory_state, memory_norm)[:, :, 0]
        factor = gate.to(acc).expand(n_batch, n_heads) if gate is not None else None
        if memory_mode == "softmax":
            fq = phi(q.to(acc))
            mass = (fq * memory_norm.to(acc)).sum(-1)  # φ(q)·z, (B, H)
            if factor is not None:
                mass = mass * factor
            log_z = (row_max + denom.log()).reshape(n_batch, n_heads)  # −∞ where no slot is valid
            weight = torch.sigmoid(mass.clamp_min(torch.finfo(acc).tiny).log() - log_z)
            weight = torch.where(mass > 0, weight, torch.zeros_like(weight))[..., None]
            out = out + weight * (readout - out)
        else:
            out = out + (readout if factor is None else readout * factor[..., None])
    return out.to(q.dtype)


def _resolve_backend(backend: str, q: Tensor, *tensors: Tensor | None) -> str:
    """:func:`~._dispatch.resolve_backend` with this kernel's limits: a kernel dtype and a head dim at most
    :data:`MAX_TRITON_HEAD_DIM`."""
    limits = (("head dims", q.shape[-1], MAX_TRITON_HEAD_DIM),)
    return resolve_backend("budgeted_attention", backend, (q, *tensors), dtype=q.dtype, limits=limits)


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::budgeted_attention", mutates_args=())
def _budgeted_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor,
    memory_state: Tensor | None,
    memory_norm: Tensor | None,
    gate: Tensor | None,
    scale: float,
    memory_mode: str,
    backend: str,
    block: int,
) -> Tensor:
    """``out (B, H, D)`` in ``q``'s dtype; ``block == 0`` means the default Triton blocks.

    Autocast is switched off inside: the reference's einsums must run in the accumulation dtype.
    """
    with torch.autocast(q.device.type, enabled=False):
        tensors = (k, v, lengths, memory_state, memory_norm, gate)
        if _resolve_backend(backend, q, *tensors) == "triton":
            from lightning_llm.kernels import _budgeted_attention_triton

            return _budgeted_attention_triton.budgeted_attention_forward(
                q, k, v, lengths, memory_state, memory_norm, gate, scale, MEMORY_EPS, block, memory_mode
            )
        return _torch_budgeted_attention(
            q, k, v, lengths, memory_state, memory_norm, gate, scale, memory_mode
        )


@_budgeted_attention_op.register_fake
def _(q, k, v, lengths, memory_state, memory_norm, gate, scale, memory_mode, backend, block):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
