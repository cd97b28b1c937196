r"""``y = x Ŵᵀ`` for a trellis-quantised weight (:mod:`lightning_llm.quantization`), decoded on the fly.

A :class:`~lightning_llm.quantization.QuantizedMatrix` stores ``Ŵ = (Q_m S_m)ᵀ diag(σ) q (Q_n S_n)`` as packed
trellis bits (``k`` per weight), per-row scales ``σ`` and the code constants. Since
``x Ŵᵀ = [ (x (Q_n S_n)ᵀ) (diag(σ) q)ᵀ ] (Q_m S_m)``::

    x̃ = H_in(x)              = RandomHadamard(n, seed_in).forward(x)        (PyTorch, fp32, :mod:`.hadamard`)
    ỹ = x̃ W̃ᵀ,  W̃ = diag(σ) q                                              (the custom op / Triton kernel)
    y = H_out⁻¹(ỹ)            = RandomHadamard(m, seed_out).inverse(ỹ)       (PyTorch, fp32)

Hadamard placement (decision). The two random Hadamard transforms are applied to the *activations* in
PyTorch around the kernel, as QTIP does: they are ``O((n + m) log)`` per row against the ``O(n·m)`` matmul,
they need the odd-factor dense rotation for non-power-of-two widths (:mod:`.hadamard`), and keeping them out of the kernel keeps the kernel a plain "decode-tile-and-dot" loop. They run
in fp32 on an fp32 copy of ``x`` (an FWHT in bf16 would round at each of its ``log n`` passes), so the
kernel always sees fp32 activations; the result is rounded once to ``x``'s dtype. ``incoherence=False``
skips both.

The core op ``lightning_llm::trellis_matmul`` (a ``torch.library`` custom op with a fake, inference only: no
autograd) computes ``ỹ``. Its reference, :func:`_torch_trellis_matmul`, decodes the whole ``q`` with the
primitives of :mod:`.trellis_decode` (any code, including 3INST and the RTN baseline; bit-exact with
:func:`lightning_llm.quantization.dequantize`) and runs one matmul; the Triton kernel (:mod:`._trellis_matmul_triton`, codes 1MAD and MUL-BAL, any ``L``, ``k·V ≤ 8``,
``V ∈ {1, 2}``) decodes ``W̃`` tile by tile inside the matmul loop from the state integer, with no table, and
works for any number of rows ``M`` of ``x`` (QTIP's kernels are batch-1 only). Dispatch follows
:mod:`._dispatch`: CUDA tensors with Triton importable and a kernel-supported code run the kernel, everything
else runs the reference.

Status and costs. The kernel is checked against the reference only under the Triton interpreter on CPU
(``tests/kernels/test_trellis_matmul.py``); it has not yet been compiled or timed on a GPU. Its grid is
``(⌈M / 16⌉, ⌈m / BLOCK_N⌉)``, and every program decodes its ``BLOCK_N × n`` slab of ``W̃`` itself, so a
batch of ``M`` rows decodes each weight ``⌈M / 16⌉`` times (once for decode-sized batches ``M ≤ 16``; for
large prefills, decoding once to a dense bf16 weight and calling a dense matmul would be cheaper, not done
here). The state is rebuilt with ``L`` one-bit reads per weight (simple and exact for any ``k·V``; a
word-level funnel shift would be faster). The matmul is an fp32 ``tl.dot`` with ``input_precision="ieee"``.
The reference decodes the whole weight on every call (no cache); ``_backend="compiled"`` (set per model with
:func:`lightning_llm.quantization.set_trellis_backend`) runs the same decode through ``torch.compile``, which
fuses it into one loop (measured on a 2-core CPU for a 1024 × 1024 layer: 60 ms → 7 ms per call).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lightning_llm.kernels._dispatch import resolve_backend
from lightning_llm.kernels.hadamard import RandomHadamard
from lightning_llm.kernels.trellis_decode import (
    CODE_IDS,
    code_values,
    rtn_levels,
    trellis_states,
    window_states,
)

__all__ = ["BACKENDS", "code_constants", "trellis_matmul"]

#: Values of ``trellis_matmul``'s ``_backend`` (and of :func:`lightning_llm.quantization.set_trellis_backend`).
BACKENDS = ("auto", "triton", "torch", "compiled")

#: The codes the Triton kernel (and the compiled decode) implement, by name and by id.
_KERNEL_CODES = ("qtip-1mad", "proteus")
_KERNEL_CODE_IDS = tuple(CODE_IDS[c] for c in _KERNEL_CODES)
_CODE_NAMES = {i: c for c, i in CODE_IDS.items()}


@functools.lru_cache(maxsize=256)
def _hadamard(n: int, seed: int) -> RandomHadamard:
    return RandomHadamard(n, seed)


def code_constants(code: str, code_params: dict) -> tuple[int, int, int, float, float]:
    """``(code_id, c0, c1, alpha, beta)`` of the op's schema from a code name and its params (the
    ``code_params`` of a :class:`~lightning_llm.quantization.QuantizedMatrix`)."""
    if code not in CODE_IDS:
        raise ValueError(f"unknown code {code!r}; expected one of {tuple(CODE_IDS)}")
    p = code_params
    if code == "qtip-1mad":
        return 0, int(p.get("a", 34038481)), int(p.get("b", 76625530)), 1.0, 0.0
    if code == "proteus":
        return 1, int(p["multiplier"]), int(p["shift"]), float(p["alpha"]), float(p["beta"])
    if code == "qtip-3inst":
        return 2, int(p.get("a", 1664525)), int(p.get("b", 1013904223)), 1.0, 0.0
    return 3, 0, 0, 1.0, 0.0


def trellis_matmul(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    shape: tuple[int, int],
    code: str,
    code_params: dict,
    *,
    L: int = 16,
    k: int = 2,
    V: int = 1,
    tile: int = 256,
    seed_out: int = 0,
    seed_in: int = 1,
    incoherence: bool = True,
    _backend: str = "auto",
    _block: int | None = None,
) -> Tensor:
    """``x Ŵᵀ`` for ``x [..., n]`` and a trellis-quantised ``Ŵ [m, n]`` (see the module docstring).

    Args:
        x: activations ``[..., n]`` (any float dtype; the result has it).
        packed: uint8 ``[tiles, tile·k/8]`` trellis bits (``QuantizedMatrix.packed``).
        scales: ``[m]`` per-row scales σ.
        shape: ``(m, n)``.
        code: ``"qtip-1mad"``, ``"proteus"`` (Triton-capable), ``"qtip-3inst"`` or ``"rtn"`` (reference only).
        code_params: the code constants (``QuantizedMatrix.code_params``).
        L, k, V, tile, seed_out, seed_in, incoherence: as in the :class:`QuantizedMatrix`.
        _backend: ``"auto"``, ``"compiled"`` (the reference's decode through ``torch.compile``), or force
            ``"triton"`` / ``"torch"`` (tests). ``_block`` forces the kernel's N/K block (a power of two ≥ 16).
    """
    m, n = shape
    if x.shape[-1] != n:
        raise ValueError(f"x has last dimension {x.shape[-1]}, expected in_features {n}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if scales.shape != (m,):
        raise ValueError(f"scales must have shape ({m},), got {tuple(scales.shape)}")
    if _backend not in BACKENDS:
        raise ValueError(f"_backend must be one of {BACKENDS}, got {_backend!r}")
    if packed.shape[1] != (tile * k + 7) // 8:
        raise ValueError(
            f"packed has {packed.shape[1]} bytes per tile, expected {(tile * k + 7) // 8} for tile={tile}, k={k}"
        )
    code_id, c0, c1, alpha, beta = code_constants(code, code_params)
    lead = x.shape[:-1]
    xr = x.reshape(-1, n).float()
    if incoherence:
        xr = _hadamard(n, seed_in).forward(xr)
    y = torch.ops.lightning_llm.trellis_matmul(
        xr.contiguous(),
        packed,
        scales.float(),
        m,
        code_id,
        c0,
        c1,
        alpha,
        beta,
        L,
        k,
        V,
        tile,
        _backend,
        _block or 0,
    )
    if incoherence:
        y = _hadamard(m, seed_out).inverse(y)
    return y.to(x.dtype).reshape(*lead, m)


def _decode_weight(
    packed: Tensor, m: int, n: int, code_id: int, c0: int, c1: int, alpha: float, beta: float, L, k, V, tile
) -> Tensor:
    """The normalised decoded ``q [m, n]`` (fp32), bit-exact with :func:`lightning_llm.quantization.dequantize`
    before its scales and Hadamards."""
    if code_id == CODE_IDS["rtn"]:
        q = rtn_levels(packed, tile, k)
    else:
        q = code_values(trellis_states(packed, tile // V, L, k * V), code_id, c0, c1, alpha, beta, V)
    return q.reshape(-1)[: m * n].view(m, n)


def _torch_trellis_matmul(
    x: Tensor, packed: Tensor, scales: Tensor, m: int, code_id, c0, c1, alpha, beta, L, k, V, tile
) -> Tensor:
    """The spec: decode all of ``q``, ``ỹ = x (diag(σ) q)ᵀ`` in fp32 (one matmul)."""
    q = _decode_weight(packed, m, x.shape[1], code_id, c0, c1, alpha, beta, L, k, V, tile).to(x.device)
    return x @ (q * scales.unsqueeze(1)).t()


def _decode_scaled(
    packed: Tensor, scales: Tensor, ints: Tensor, floats: Tensor, m: int, n: int, code_id: int, L, k, V, tile
) -> Tensor:
    """``diag(σ) q [m, n]`` for 1MAD / MUL-BAL, the code constants as tensors: ``ints = [c0, c1]`` (int64),
    ``floats = [α, β]``.

    The code functions of :mod:`.trellis_decode` with the constants passed as tensors, so that
    ``torch.compile`` sees them as data, not as Python numbers: one compiled graph per layer shape serves every
    layer of that shape (constants baked in would recompile for every layer).
    """
    states = window_states(packed, tile // V, L, k * V)
    q = (
        code_values(states, code_id, ints[0], ints[1], floats[0], floats[1], V)
        .reshape(-1)[: m * n]
        .view(m, n)
    )
    return q * scales.unsqueeze(1)


@functools.cache
def _compiled_decode():
    return torch.compile(_decode_scaled, dynamic=False)


def _compiled_trellis_matmul(
    x: Tensor, packed: Tensor, scales: Tensor, m: int, code_id, c0, c1, alpha, beta, L, k, V, tile
) -> Tensor:
    """The reference's ``x (diag(σ) q)ᵀ`` with the decode compiled by ``torch.compile`` (CPU or GPU).

    The first call per layer shape compiles (seconds); later calls run the state extraction, the code and the
    scaling as one generated loop (≈ 8x faster than the eager reference on a CPU). Codes 1MAD and MUL-BAL;
    the others fall back to the eager reference.
    """
    if code_id not in _KERNEL_CODE_IDS or (tile // V) * k * V % 8 or L > 24:
        return _torch_trellis_matmul(x, packed, scales, m, code_id, c0, c1, alpha, beta, L, k, V, tile)
    ints = torch.tensor([c0, c1], dtype=torch.int64, device=packed.device)
    floats = torch.tensor([alpha, beta], dtype=torch.float32, device=packed.device)
    weight = _compiled_decode()(packed, scales, ints, floats, m, x.shape[1], code_id, L, k, V, tile)
    return x @ weight.t()


def _resolve_backend(backend: str, code_id: int, V: int, k: int, x: Tensor, *tensors: Tensor) -> str:
    """:func:`~._dispatch.resolve_backend` with this kernel's limits: codes 1MAD and MUL-BAL, ``V`` in
    ``(1, 2)`` and ``k·V <= 8`` (``x`` is the rotated fp32 activations)."""
    choices = (("codes", _CODE_NAMES[code_id], _KERNEL_CODES), ("V", V, (1, 2)))
    limits = (("k·V", k * V, 8),)
    return resolve_backend(
        "trellis_matmul", backend, (x, *tensors), dtype=x.dtype, limits=limits, choices=choices
    )


@torch.library.custom_op("lightning_llm::trellis_matmul", mutates_args=())
def _trellis_matmul_op(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
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
    backend: str,
    block: int,
) -> Tensor:
    """``ỹ [M, n_out]`` fp32 from the rotated ``x [M, n]`` fp32 (no Hadamards here)."""
    with torch.autocast(x.device.type, enabled=False):
        if _resolve_backend(backend, code_id, V, k, x, packed, scales) == "triton":
            from lightning_llm.kernels import _trellis_matmul_triton

            return _trellis_matmul_triton.trellis_matmul_forward(
                x, packed, scales, n_out, code_id, c0, c1, alpha, beta, L, k, V, tile, block
            )
        if backend == "compiled":
            return _compiled_trellis_matmul(
                x, packed, scales, n_out, code_id, c0, c1, alpha, beta, L, k, V, tile
            )
        return _torch_trellis_matmul(x, packed, scales, n_out, code_id, c0, c1, alpha, beta, L, k, V, tile)


@_trellis_matmul_op.register_fake
def _(x, packed, scales, n_out, code_id, c0, c1, alpha, beta, L, k, V, tile, backend, block):
    return x.new_empty(x.shape[0], n_out, dtype=torch.float32)
