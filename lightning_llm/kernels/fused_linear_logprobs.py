r"""Per-token log-probabilities and entropies of an LM head without materialising the logits.

RL-style post-training (GRPO, PPO, entropy regularisers) needs, for every generated token, the log-prob
of that token and the entropy of the full next-token distribution, plus gradients of both. The naive way
builds ``[tokens, vocab]`` logits (several GiB for 8k tokens × 150k vocab), a same-sized
``log_softmax``, and more of the same in backward. This op processes ``chunk_size`` tokens at a time,
keeps only two floats per token (``lse`` and ``H``) for backward, and recomputes each chunk's logits there.

Math (``T`` = temperature, ``z = hidden @ Wᵀ / T``, ``p = softmax(z)``, ``y`` = target)::

    lse      = log Σ_j exp(z_j)
    log p_y  = z_y − lse
    H        = −Σ_j p_j log p_j = lse − Σ_j p_j z_j
    ∂ log p_y / ∂z_j = 1[j = y] − p_j
    ∂ H / ∂z_j       = −p_j (log p_j + H)

so with upstream grads ``g_lp``, ``g_H`` the gradient w.r.t. the raw logits ``ℓ = hidden @ Wᵀ`` is
``dℓ = (g_lp (onehot(y) − p) − g_H p (log p + H)) / T``, and ``grad_hidden = dℓ @ W``,
``grad_W = dℓᵀ @ hidden``.

Entropy dynamics (arXiv 2602.03392, ``with_dynamics=True``; spec: :func:`entropy_dynamics_reference`).
Writing ``S_j = p_j (log p_j + H)`` (so ``∂H/∂z_j = −S_j``) and ``k = y`` for the sampled token::

    S_k = p_k (H + log p_k)          raising z_k by ε changes H by −ε · S_k
    N   = Σ_i p_i² (log p_i + H)     = Σ_i p_i S_i

A policy-gradient step on token ``k`` with advantage ``A`` and step ``η`` moves the logits by
``ηA (onehot(k) − p)`` (the gradient of ``log p_k``), hence ``ΔH ≈ −ηA (S_k − N)`` to first order. Both
come out of the same forward pass as two more per-row reductions (``Σ p²`` and ``Σ p² log p``); they are
returned detached (they drive token masks and monitors, not losses).

Structure (shared by both backends, so the reference *is* the spec of the kernels)::

    forward, per chunk:  ℓ = h_c @ Wᵀ (torch matmul, input dtype)  →  row stats (lse, H, log p_y)
    backward, per chunk: ℓ = h_c @ Wᵀ again  →  ℓ := dℓ in place  →  grad_h_c = dℓ @ W,  grad_W += dℓᵀ @ h_c

The row work is either the Triton kernels in :mod:`._fused_linear_logprobs_triton` (CUDA tensors with
Triton installed) or the PyTorch functions :func:`_torch_row_stats` / :func:`_torch_row_grad_` here.
The public function is a ``torch.library.custom_op`` with a registered fake and autograd formula, so it
is opaque to, and works under, ``torch.compile``: ``lightning_llm::fused_linear_logprobs`` for the default
outputs and ``lightning_llm::fused_linear_logprobs_dynamics`` (same arguments, two more outputs, same
backward op) for ``with_dynamics=True``, so the default op's schema and work are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, overload

import torch
from torch import Tensor

from lightning_llm.kernels._common import BACKENDS, check_dtypes
from lightning_llm.kernels._dispatch import TRITON_DTYPES, resolve_backend

__all__ = ["DEFAULT_CHUNK_BYTES", "entropy_dynamics_reference", "fused_linear_logprobs"]

#: Default memory budget for one chunk of logits (in the input dtype). ``chunk_size`` defaults to
#: ``max(1, DEFAULT_CHUNK_BYTES // (vocab * itemsize))`` tokens, e.g. 524 tokens for a 32k fp32 vocab or
#: 223 for a 150k bf16 vocab: large enough that the chunk matmul keeps the GPU busy, small enough that
#: the logits never dominate memory. The reference path adds a few fp32 temporaries of the same shape.
DEFAULT_CHUNK_BYTES = 64 * 2**20


@overload
def fused_linear_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int | None = ...,
    temperature: float = ...,
    with_dynamics: Literal[False] = ...,
) -> tuple[Tensor, Tensor]: ...


@overload
def fused_linear_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int | None = ...,
    temperature: float = ...,
    with_dynamics: Literal[True],
) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


def fused_linear_logprobs(
    hidden: Tensor,
    lm_head_weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_dynamics: bool = False,
) -> tuple[Tensor, ...]:
    r"""Log-prob of ``targets`` and full-vocabulary entropy under ``softmax(hidden @ lm_head_weightᵀ / T)``.

    Computes, chunk by chunk over tokens and never for all tokens at once, ``log p_y`` and
    ``H = −Σ_j p_j log p_j``, differentiable w.r.t. ``hidden`` and ``lm_head_weight`` through both outputs.

    With ``with_dynamics=True`` the same pass also returns the entropy-dynamics terms of arXiv 2602.03392
    (docs/methods.md §3), with ``z = logits / T``, ``p = softmax(z)`` and ``k = y`` the target (sampled) token::

        S_k = p_k (H + log p_k)        # raising z_k by ε changes H by −ε·S_k   (∂H/∂z_k = −S_k)
        N   = Σ_i p_i² (log p_i + H)   # a policy-gradient step on token k, z ← z + ηA(onehot(k) − p),
                                       # changes H by ≈ −ηA (S_k − N)

    They are derivatives w.r.t. the tempered logits ``z`` (w.r.t. the raw logits, divide by ``T``), are
    computed in fp32 and are detached: no gradient flows through them, and ``logprobs`` / ``entropy`` and
    their gradients are exactly those of the default call. :func:`entropy_dynamics_reference` is the
    full-vocabulary spec (``S`` for every token, not only the target).

    Args:
        hidden: ``[..., H]`` final hidden states, fp32/bf16/fp16.
        lm_head_weight: ``[V, H]`` LM-head (unembedding) weight, same dtype and device as ``hidden``.
        targets: ``[...]`` integer token ids in ``[0, V)``, same leading shape as ``hidden``. There is no
            ``ignore_index``: compute every position and mask the outputs.
        chunk_size: tokens per chunk; default keeps a chunk's logits near :data:`DEFAULT_CHUNK_BYTES`.
        temperature: ``T > 0`` dividing the logits before the softmax.
        with_dynamics: also return ``(s_target, n)``; costs two more per-row reductions in the forward
            pass and nothing in backward. ``False`` runs exactly the default kernels.

    Returns:
        ``(logprobs, entropy)``, or ``(logprobs, entropy, s_target, n)`` with ``with_dynamics=True``; all
        fp32 with shape ``hidden.shape[:-1]``.

    Reductions run in fp32 whatever the input dtype; the logits chunk and its in-place gradient are in
    the input dtype (as a plain ``nn.Linear`` head would produce them); ``grad_W`` is accumulated across
    chunks in fp32 (an extra ``V × H`` fp32 buffer during backward) and returned in the weight's dtype.
    Inputs under ``torch.autocast`` are not re-cast: pass both tensors in the dtype you want.
    """
    return _fused_linear_logprobs(
        hidden,
        lm_head_weight,
        targets,
        chunk_size=chunk_size,
        temperature=temperature,
        with_dynamics=with_dynamics,
    )


def _fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_dynamics: bool = False,
    _backend: str = "auto",
    _block_v: int | None = None,
) -> tuple[Tensor, ...]:
    """:func:`fused_linear_logprobs` with test hooks.

    ``_backend`` forces ``"triton"`` (CPU tensors then need ``TRITON_INTERPRET=1``) or ``"torch"``;
    ``_block_v`` forces the Triton vocabulary block so tests can exercise multi-block rows and masking on
    small vocabularies.
    """
    _validate(hidden, weight, targets, chunk_size, temperature, _backend, _block_v)
    if not isinstance(with_dynamics, bool):
        raise TypeError(f"with_dynamics must be a bool, got {with_dynamics!r}")
    leading = hidden.shape[:-1]
    op = (
        torch.ops.lightning_llm.fused_linear_logprobs_dynamics
        if with_dynamics
        else torch.ops.lightning_llm.fused_linear_logprobs
    )
    logprobs, entropy, _, *dynamics = op(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).to(torch.long),
        chunk_size or 0,
        float(temperature),
        _backend,
        _block_v or 0,
    )
    return tuple(t.reshape(leading) for t in (logprobs, entropy, *dynamics))


def _validate(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int | None,
    temperature: float,
    backend: str,
    block_v: int | None,
) -> None:
    """Static checks (shapes, dtypes, scalars), done before the op so they also run under torch.compile.

    The data-dependent check (targets in range) needs the values and runs inside the op.
    """
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"lm_head_weight must have shape [V, H], got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError("lm_head_weight has an empty vocabulary (V = 0)")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is {tuple(hidden.shape)} but lm_head_weight is "
            f"{tuple(weight.shape)} (expected [V, {hidden.shape[-1]}])"
        )
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    check_dtypes(
        "hidden",
        {"hidden": hidden, "lm_head_weight": weight},
        supported=TRITON_DTYPES,
        hint="; cast one of them",
    )
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"hidden, lm_head_weight and targets must be on one device, got "
            f"{hidden.device}, {weight.device}, {targets.device}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"_backend must be one of {BACKENDS}, got {backend!r}")
    if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
        raise ValueError(f"_block_v must be a power of two, got {block_v!r}")


# --------------------------------------------------------------------------------------------------
# Reference row functions (the spec of the Triton kernels)
# --------------------------------------------------------------------------------------------------


def entropy_dynamics_reference(logits: Tensor) -> tuple[Tensor, Tensor]:
    r"""Entropy-dynamics terms of arXiv 2602.03392 (docs/methods.md §3) over the full vocabulary: the spec.

    For ``p = softmax(z)`` over the last dimension of ``z = logits`` and ``H = −Σ_i p_i log p_i``::

        S_j = p_j (H + log p_j)          ∂H/∂z_j = −S_j: raising logit j by ε changes H by −ε·S_j
        N   = Σ_i p_i² (log p_i + H)     = Σ_i p_i S_i = E_p[S]

    A policy-gradient step on sampled token ``k`` with advantage ``A`` and learning rate ``η`` moves the
    logits by ``ηA ∇_z log p_k = ηA (onehot(k) − p)``, so to first order

        ΔH ≈ Σ_j (−S_j) · ηA (1[j = k] − p_j) = −ηA (S_k − N).

    ``S`` sums to zero over the vocabulary (``Σ_j S_j = −H + H = 0``), which is why a uniform shift of the
    logits leaves ``H`` unchanged. :func:`fused_linear_logprobs` with ``with_dynamics=True`` returns
    ``S_y`` (gathered at the target) and ``N`` without materialising the logits; this function is for
    tests and models small enough to hold ``[..., V]``. Apply any temperature to ``logits`` first.

    Args:
        logits: ``[..., V]`` logits ``z``, any floating dtype.

    Returns:
        ``(S, N)`` with shapes ``[..., V]`` and ``[...]``, computed and returned in fp32, or in fp64 for
        fp64 input. Plain autograd-traceable PyTorch (the fused op's are detached).
    """
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(dim=-1, keepdim=True)
    s = p * (log_p + entropy)
    return s, (p * s).sum(dim=-1)


def _torch_row_stats(
    logits: Tensor,
    targets: Tensor,
    inv_temperature: float,
    logprobs: Tensor,
    entropy: Tensor,
    lse: Tensor,
    s_target: Tensor | None = None,
    n: Tensor | None = None,
) -> None:
    """Fill ``logprobs`` (log p_y), ``entropy`` (−Σ p log p) and ``lse`` for one ``[rows, V]`` chunk.

    Everything is computed in fp32 from ``z = logits · inv_temperature``. When ``s_target`` and ``n`` are
    given they are filled too (entropy dynamics, see :func:`entropy_dynamics_reference`)::

        s_target = p_y (H + log p_y)
        n        = Σ_j p_j² (log p_j + H)

    ``logprobs``, ``entropy`` and ``lse`` are computed by the same operations either way, so the
    dynamics outputs never change them (or the gradients that use them).
    """
    log_p = logits.float() * inv_temperature
    chunk_lse = torch.logsumexp(log_p, dim=-1)
    log_p -= chunk_lse[:, None]
    lse.copy_(chunk_lse)
    entropy.copy_(-(log_p.exp() * log_p).sum(dim=-1))
    logprobs.copy_(log_p.gather(1, targets[:, None]).squeeze(1))
    if s_target is not None and n is not None:
        s_target.copy_(logprobs.exp() * (logprobs + entropy))
        p_sq = log_p.exp().square_()
        log_p += entropy[:, None]  # log p + H, in place
        n.copy_(p_sq.mul_(log_p).sum(dim=-1))


def _torch_row_grad_(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    inv_temperature: float,
) -> None:
    """Overwrite one ``[rows, V]`` chunk of raw logits with d(loss)/d(raw logits).

    ``dz = g_lp (onehot(y) − p) − g_H p (log p + H)`` with ``p`` recomputed from the saved ``lse``, then
    scaled by ``inv_temperature`` for the chain rule through ``z = logits / T``.
    """
    log_p = logits.float() * inv_temperature - lse[:, None]
    p = log_p.exp()
    dz = -p * (grad_logprobs[:, None] + grad_entropy[:, None] * (log_p + entropy[:, None]))
    dz.scatter_add_(1, targets[:, None], grad_logprobs[:, None])
    logits.copy_(dz * inv_temperature)


# --------------------------------------------------------------------------------------------------
# Chunked drivers (shared by both backends)
# --------------------------------------------------------------------------------------------------


def _resolve_backend(backend: str, hidden: Tensor, *tensors: Tensor) -> str:
    """:func:`~._dispatch.resolve_backend` for this op (its kernels take every dtype it accepts)."""
    return resolve_backend("fused_linear_logprobs", backend, (hidden, *tensors), dtype=hidden.dtype)


def _row_functions(backend: str, block_v: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """(row_stats, row_grad_) for a resolved backend; imports Triton only when it is actually used."""
    if backend == "triton":
        from lightning_llm.kernels import _fused_linear_logprobs_triton as tk

        return partial(tk.row_stats, block_v=block_v), partial(tk.row_grad_, block_v=block_v)
    return _torch_row_stats, _torch_row_grad_


def _resolve_chunk_size(chunk_size: int, n_tokens: int, weight: Tensor) -> int:
    """``chunk_size`` tokens per chunk, or the :data:`DEFAULT_CHUNK_BYTES` rule when it is 0."""
    if chunk_size <= 0:
        chunk_size = DEFAULT_CHUNK_BYTES // (weight.shape[0] * weight.element_size())
    return max(1, min(chunk_size, n_tokens))


def _check_targets(targets: Tensor, n_vocab: int) -> None:
    """Raise on token ids outside ``[0, V)``: the kernels would otherwise read out of bounds silently.

    One host sync per call on CUDA.
    """
    if targets.numel() and bool(((targets < 0) | (targets >= n_vocab)).any()):
        bad = targets[(targets < 0) | (targets >= n_vocab)]
        raise ValueError(
            f"targets must lie in [0, {n_vocab}) (the vocabulary of lm_head_weight); "
            f"found {bad.numel()} out of range, e.g. {bad[:5].tolist()}"
        )


def _forward_chunks(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
    backend: str,
    block_v: int,
    with_dynamics: bool = False,
) -> tuple[Tensor, ...]:
    """(logprobs, entropy, lse[, s_target, n]), each fp32 ``[N]``, for ``hidden [N, H]``.

    One ``[chunk, V]`` logits buffer is live at a time. ``s_target`` and ``n`` (entropy dynamics) are
    filled by the same row pass when ``with_dynamics``.
    """
    n_tokens, n_vocab = hidden.shape[0], weight.shape[0]
    _check_targets(targets, n_vocab)
    backend = _resolve_backend(backend, hidden, weight)
    chunk = _resolve_chunk_size(chunk_size, n_tokens, weight)
    inv_t = 1.0 / temperature
    n_out = 5 if with_dynamics else 3
    outputs = tuple(hidden.new_empty(n_tokens, dtype=torch.float32) for _ in range(n_out))
    targets = targets.contiguous()
    row_stats, _ = _row_functions(backend, block_v)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        logits = hidden[start:end] @ weight.T
        row_stats(logits, targets[start:end], inv_t, *(out[start:end] for out in outputs))
    return outputs


def _backward_chunks(
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    chunk_size: int,
    temperature: float,
    backend: str,
    block_v: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """(grad_hidden, grad_weight); an unneeded one is returned as an empty tensor and never computed.

    ``grad_W`` is accumulated in fp32 across chunks; each chunk's ``dℓᵀ @ h_c`` is a single matmul in the
    input dtype (fp32 accumulation inside cuBLAS), so the low-precision rounding happens once per chunk and
    never compounds over the token dimension.
    """
    n_tokens = hidden.shape[0]
    backend = _resolve_backend(backend, hidden, weight)
    chunk = _resolve_chunk_size(chunk_size, n_tokens, weight)
    inv_t = 1.0 / temperature
    # contiguous (not empty_like, which copies a strided input's layout) so each chunk's out= slice is dense
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden else (0,))
    grad_weight32 = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    )
    targets, lse, entropy = targets.contiguous(), lse.contiguous(), entropy.contiguous()
    grad_logprobs = grad_logprobs.to(torch.float32).contiguous()
    grad_entropy = grad_entropy.to(torch.float32).contiguous()
    _, row_grad_ = _row_functions(backend, block_v)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h_c = hidden[start:end]
        grad_logits = h_c @ weight.T  # recomputed logits, overwritten in place with their gradient
        rows = slice(start, end)
        row_grad_(
            grad_logits,
            targets[rows],
            lse[rows],
            entropy[rows],
            grad_logprobs[rows],
            grad_entropy[rows],
            inv_t,
        )
        if need_hidden:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        if grad_weight32 is not None:
            if grad_weight32.dtype == grad_logits.dtype:
                grad_weight32.addmm_(grad_logits.T, h_c)
            else:
                grad_weight32 += grad_logits.T @ h_c
    grad_weight = grad_weight32.to(weight.dtype) if grad_weight32 is not None else weight.new_empty(0)
    return grad_hidden, grad_weight


# --------------------------------------------------------------------------------------------------
# torch.library registration
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("lightning_llm::fused_linear_logprobs", mutates_args=())
def _fused_linear_logprobs_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
    backend: str,
    block_v: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Flat ``[N, H]`` op returning (logprobs, entropy, lse); ``lse`` is only kept for backward.

    ``chunk_size == 0`` / ``block_v == 0`` mean "default". Autocast is switched off inside so the logits
    buffer keeps the input dtype that the in-place gradient and the backward matmuls rely on.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        return _forward_chunks(hidden, weight, targets, chunk_size, temperature, backend, block_v)


@_fused_linear_logprobs_op.register_fake
def _(hidden, weight, targets, chunk_size, temperature, backend, block_v):
    n_tokens = hidden.shape[0]
    return tuple(hidden.new_empty(n_tokens, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("lightning_llm::fused_linear_logprobs_dynamics", mutates_args=())
def _fused_linear_logprobs_dynamics_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_size: int,
    temperature: float,
    backend: str,
    block_v: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward op plus entropy dynamics: (logprobs, entropy, lse, s_target, n).

    A separate op rather than a flag on the first one so that each has a fixed output arity and the
    default op's schema is untouched. Same backward op; ``lse``, ``s_target`` and ``n`` are
    non-differentiable.
    """
    with torch.autocast(hidden.device.type, enabled=False):
        return _forward_chunks(
            hidden, weight, targets, chunk_size, temperature, backend, block_v, with_dynamics=True
        )


@_fused_linear_logprobs_dynamics_op.register_fake
def _(hidden, weight, targets, chunk_size, temperature, backend, block_v):
    n_tokens = hidden.shape[0]
    return tuple(hidden.new_empty(n_tokens, dtype=torch.float32) for _ in range(5))


@torch.library.custom_op("lightning_llm::fused_linear_logprobs_backward", mutates_args=())
def _fused_linear_logprobs_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    chunk_size: int,
    temperature: float,
    backend: str,
    block_v: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """Backward of the forward op as its own op, so ``torch.compile`` treats the chunk loop as opaque."""
    with torch.autocast(hidden.device.type, enabled=False):
        return _backward_chunks(
            grad_logprobs,
            grad_entropy,
            hidden,
            weight,
            targets,
            lse,
            entropy,
            chunk_size,
            temperature,
            backend,
            block_v,
            need_hidden,
            need_weight,
        )


@_fused_linear_logprobs_backward_op.register_fake
def _(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    targets,
    lse,
    entropy,
    chunk_size,
    temperature,
    backend,
    block_v,
    need_hidden,
    need_weight,
):
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden else (0,))
    grad_weight = weight.new_empty(weight.shape if need_weight else (0,))
    return grad_hidden, grad_weight


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    """Shared by both forward ops: everything after ``(logprobs, entropy)`` is non-differentiable."""
    hidden, weight, targets, chunk_size, temperature, backend, block_v = inputs
    _, entropy, lse, *dynamics = output
    ctx.mark_non_differentiable(lse, *dynamics)
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.config = (chunk_size, temperature, backend, block_v)


def _backward(
    ctx: Any, grad_logprobs: Tensor | None, grad_entropy: Tensor | None, *_grad_rest: Tensor | None
) -> tuple[Tensor | None, ...]:
    """Backward of both forward ops; grads of ``lse`` / ``s_target`` / ``n`` are ignored (always zero)."""
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(lse)
    grad_hidden, grad_weight = torch.ops.lightning_llm.fused_linear_logprobs_backward(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        targets,
        lse,
        entropy,
        *ctx.config,
        need_hidden,
        need_weight,
    )
    return (
        grad_hidden if need_hidden else None,
        grad_weight if need_weight else None,
        None,
        None,
        None,
        None,
        None,
    )


_fused_linear_logprobs_op.register_autograd(_backward, setup_context=_setup_context)
_fused_linear_logprobs_dynamics_op.register_autograd(_backward, setup_context=_setup_context)
