r"""Weight-matrix quantisation: incoherence processing + 2-bit trellis-coded quantisation (Proteus / QTIP).

:func:`quantize_matrix` ``(W, code, bits, L, V, seed)`` for ``W [m, n]``:

1. Incoherence processing (:mod:`.hadamard`): ``W̃ = (Q_m S_m) W (Q_n S_n)ᵀ`` with seeds ``(2·seed,
   2·seed + 1)``; ``W̃``'s entries are close to i.i.d. Gaussian.
2. Per-row normalisation ``X_i = W̃_i / r_i``, ``r_i = rms(W̃_i)``, so the trellis sees ≈ N(0, 1).
3. The flattened ``X`` (row-major, zero-padded to a multiple of 256) is cut into tiles of 256 weights and each
   tile is encoded by the tail-biting Viterbi (:func:`.trellis.viterbi`) with the chosen code and packed to
   exactly ``bits`` bits per weight (``32·bits`` bytes per tile).
4. Channel compensation: with ``q_i`` the decoded row ``i`` (in normalised units), each output row's scale is
   refit by least squares, ``σ_i = r_i · ⟨X_i, q_i⟩ / ⟨q_i, q_i⟩``, the scale minimising ``‖W̃_i − σ_i q_i‖²``.

:func:`dequantize` inverts: ``Ŵ = (Q_m S_m)ᵀ diag(σ) q (Q_n S_n)``.

Codes: ``"qtip-1mad"``, ``"qtip-3inst"`` (:mod:`.codes`) are fixed; ``"proteus"`` (MUL-BAL) picks its
generator ``(multiplier, shift)`` per layer from :data:`.codes.MULBAL_CANDIDATES` by the proxy error, the MSE
after a least-squares affine fit ``α g + β``, of quantising ``proxy_tiles`` random tiles of ``X``; the full
layer is then encoded with the fitted ``α, β``, which are refit by least squares on the whole layer afterwards
(states fixed, so the stored bits stay valid). ``"rtn"`` is the round-to-nearest baseline: ``2^bits`` uniform
symmetric levels ``(j − (2^bits − 1)/2)·Δ_i`` per output row, ``Δ_i`` the MSE-best step on a grid
(after the same incoherence processing unless ``incoherence=False``).

Runtime. Encoding cost is ``O(n_weights / V · 2^L)``, two Viterbi passes per tile for tail-biting, plus the
Proteus candidate search's 8 × ``proxy_tiles`` tiles. On CPU tensors :func:`.trellis.viterbi` uses the compiled
Viterbi (:mod:`._viterbi_cpp`, the same bits as the torch reference); measured on the development machine (one
thread, process CPU time; 2 cores shared with other jobs) on SmolLM2's 576 × 1536 ``gate_proj``: about 10 s with
the torch reference and 2 s compiled at L = 12, and 16x that at L = 16 (``benchmarks/results/viterbi_speed.json``).
With the torch reference, a 1024 × 1024 N(0, 1) matrix at L = 16 took 496 s of CPU (MSE 0.0685; V = 2: 328 s,
MSE 0.0690).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_llm.kernels.trellis_decode import pack_chunks, rtn_levels

from .codes import MULBAL_CANDIDATES, MulBalCode, make_code
from .hadamard import incoherence_process, incoherence_unprocess
from .ldlq import DEFAULT_DAMP, block_ldlq, damp_hessian, incoherence_hessian
from .trellis import decode_packed, pack, viterbi

__all__ = ["QuantizedMatrix", "decode_normalized", "dequantize", "quantize_matrix"]

_CODES = ("proteus", "qtip-1mad", "qtip-3inst", "rtn")


@dataclass
class QuantizedMatrix:
    """A quantised ``[m, n]`` matrix: packed bits, per-row scales and everything needed to decode."""

    packed: Tensor  # uint8 [tiles, tile·bits/8]
    scales: Tensor  # float32 [m], per-output-channel σ_i
    shape: tuple[int, int]
    code: str
    code_params: dict = field(default_factory=dict)
    #: Encode-time statistics, not stored by ``TrellisLinear``: with a Hessian, ``proxy_error`` =
    #: ``tr(ΔW H ΔWᵀ)`` under the damped ``H`` and ``proxy_relative`` = that over ``tr(W H Wᵀ)``.
    stats: dict = field(default_factory=dict)
    bits: int = 2
    L: int = 16
    V: int = 1
    tile: int = 256
    seed_out: int = 0
    seed_in: int = 1
    incoherence: bool = True

    @property
    def bits_per_weight(self) -> float:
        """Bits of ``packed`` per weight of the matrix (excludes the ``m`` scales and the zero padding)."""
        return self.packed.numel() * 8 / (self.shape[0] * self.shape[1])


def _tiles(X: Tensor, tile: int) -> Tensor:
    flat = X.reshape(-1)
    pad = (-flat.numel()) % tile
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, tile)


def _untile(tiles: Tensor, shape: tuple[int, int]) -> Tensor:
    return tiles.reshape(-1)[: shape[0] * shape[1]].view(shape)


def _affine_fit(g: Tensor, x: Tensor) -> tuple[float, float]:
    """Least squares ``min_{α,β} ‖x − (α g + β)‖²``."""
    g, x = g.double().reshape(-1), x.double().reshape(-1)
    gm, xm = g.mean(), x.mean()
    var = ((g - gm) ** 2).sum()
    alpha = float(((g - gm) * (x - xm)).sum() / var) if var > 0 else 1.0
    return alpha, float(xm - alpha * gm)


def _select_mulbal(
    tiles: Tensor, bits: int, L: int, V: int, candidates, proxy_tiles: int, seed: int
) -> tuple[MulBalCode, dict]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(tiles.shape[0], generator=g)[:proxy_tiles]
    sub = tiles[idx]
    best, errors = None, {}
    for mult, shift in candidates:
        code = MulBalCode(V=V, multiplier=mult, shift=shift)
        states, _ = viterbi(sub, code, L, bits, V)
        gval = code(states).reshape(sub.shape)
        alpha, beta = _affine_fit(gval, sub)
        mse = float(((alpha * gval + beta - sub) ** 2).mean())
        errors[(mult, shift)] = mse
        if best is None or mse < best[0]:
            best = (mse, code.with_affine(alpha, beta))
    return best[1], errors


def _rtn(X: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Per-row MSE-best symmetric uniform grid; returns (indices [m, n] int64, step Δ [m])."""
    levels = 1 << bits
    offset = (levels - 1) / 2
    rms = X.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)
    best_err, best_step, best_idx = None, None, None
    for f in torch.linspace(0.1, 1.6, 76).tolist():  # Δ / rms on a grid (2-bit optimum on N(0,1): ≈ 1.0)
        step = rms * f
        idx = torch.clamp(torch.round(X / step + offset), 0, levels - 1)
        err = ((idx - offset) * step - X).pow(2).sum(1)
        if best_err is None:
            best_err, best_step, best_idx = err, step.squeeze(1), idx
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_step = torch.where(better, step.squeeze(1), best_step)
            best_idx = torch.where(better.unsqueeze(1), idx, best_idx)
    return best_idx.to(torch.int64), best_step


def quantize_matrix(
    W: Tensor,
    code: str = "proteus",
    bits: int = 2,
    L: int = 16,
    V: int = 1,
    seed: int = 0,
    *,
    tile: int = 256,
    incoherence: bool = True,
    proxy_tiles: int = 4,
    candidates=MULBAL_CANDIDATES,
    chunk_tiles: int = 32,
    hessian: Tensor | None = None,
    damp: float = DEFAULT_DAMP,
    ldlq_block: int | None = None,
) -> QuantizedMatrix:
    """Quantise ``W [m, n]`` to ``bits`` bits per weight (see the module docstring).

    ``hessian`` (``[n, n]``, the proxy Hessian ``E[x xᵀ]`` of the layer's inputs) switches the rounding to
    BlockLDLQ (:func:`.ldlq.block_ldlq`) under ``H`` damped by ``damp`` (relative to its mean diagonal) and
    rotated like ``W``'s inputs: the trellis codes quantise each tile with the Viterbi as the block quantiser
    (blocks = the tiles of ``tile`` weights, so ``ldlq_block`` must be None or ``tile``); RTN rounds entry by entry
    with feedback blocks of ``ldlq_block`` entries (default 1: column-by-column LDLQ) on the same per-row grid as
    without a Hessian. Every least-squares fit is then taken in the ``H`` metric: Proteus's generator is chosen by
    the proxy error of BlockLDLQ on a few whole groups of rows, its affine ``α, β`` and the channel scales ``σ_i``
    minimise ``tr(ΔW̃ H̃ ΔW̃ᵀ)`` instead of ``‖ΔW̃‖²``. The proxy error is returned in ``stats``. Without a
    Hessian the encoding is data-free, as described in the module docstring.
    """
    if hessian is not None:
        return _quantize_ldlq(
            W,
            code,
            bits,
            L,
            V,
            seed,
            tile,
            incoherence,
            proxy_tiles,
            candidates,
            chunk_tiles,
            hessian,
            damp,
            ldlq_block,
        )
    if W.dim() != 2:
        raise ValueError(f"W must be a matrix, got shape {tuple(W.shape)}")
    if code not in _CODES:
        raise ValueError(f"code must be one of {_CODES}, got {code!r}")
    if bits < 1:
        raise ValueError(f"bits must be positive, got {bits}")
    m, n = W.shape
    seed_out, seed_in = 2 * seed, 2 * seed + 1
    Wt = W.detach().float()
    if incoherence:
        Wt = incoherence_process(Wt, seed_out, seed_in)
    common = dict(
        shape=(m, n),
        bits=bits,
        L=L,
        V=V,
        tile=tile,
        seed_out=seed_out,
        seed_in=seed_in,
        incoherence=incoherence,
    )
    if code == "rtn":
        idx, step = _rtn(Wt, bits)
        packed = pack_chunks(_tiles(idx, tile), bits)
        return QuantizedMatrix(packed=packed, scales=step.float(), code="rtn", code_params={}, **common)
    if tile % V != 0:
        raise ValueError(f"tile={tile} must be a multiple of V={V}")
    rms = Wt.pow(2).mean(1).sqrt().clamp_min(1e-12)
    X = Wt / rms.unsqueeze(1)
    tiles = _tiles(X, tile)
    params: dict = {}
    if code == "proteus":
        c, errors = _select_mulbal(tiles, bits, L, V, candidates, proxy_tiles, seed)
        params["proxy_errors"] = errors
    else:
        c = make_code(code, V=V)
    states, _ = viterbi(tiles, c, L, bits, V, tail_biting=True, chunk_tiles=chunk_tiles)
    if code == "proteus":
        gval = MulBalCode(V=V, multiplier=c.multiplier, shift=c.shift)(states).reshape(tiles.shape)
        c = c.with_affine(*_affine_fit(gval, tiles))
    q = _untile(c(states).reshape(tiles.shape), (m, n))
    # Channel compensation: least-squares scale per output row.
    qq = q.pow(2).sum(1).clamp_min(1e-12)
    scales = rms * (X * q).sum(1) / qq
    params.update(c.params())
    return QuantizedMatrix(
        packed=pack(states, L, bits, V), scales=scales, code=code, code_params=params, **common
    )


def _check_args(W: Tensor, code: str, bits: int) -> None:
    if W.dim() != 2:
        raise ValueError(f"W must be a matrix, got shape {tuple(W.shape)}")
    if code not in _CODES:
        raise ValueError(f"code must be one of {_CODES}, got {code!r}")
    if bits < 1:
        raise ValueError(f"bits must be positive, got {bits}")


def _affine_fit_h(g: Tensor, x: Tensor, H: Tensor) -> tuple[float, float]:
    """``min_{α,β} Σ_i (x_i − α g_i − β 1) H (x_i − α g_i − β 1)ᵀ`` over the rows of ``g, x [m, n]``."""
    g, x = g.double(), x.double()
    gh, ones_h = g @ H, H.sum(0)
    a11, a12, a22 = float((gh * g).sum()), float(gh.sum()), float(H.sum()) * g.shape[0]
    b1, b2 = float((gh * x).sum()), float((x * ones_h).sum())
    det = a11 * a22 - a12 * a12
    if not abs(det) > 1e-12 * max(a11 * a22, 1e-300):
        return 1.0, 0.0
    return (b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det


def _scales_h(Wt: Tensor, q: Tensor, H: Tensor) -> Tensor:
    """Per-row ``σ_i = ⟨W̃_i, q_i⟩_H / ⟨q_i, q_i⟩_H``, the scale minimising ``(W̃_i − σ_i q_i) H (·)ᵀ``."""
    qh = q.double() @ H
    return ((qh * Wt.double()).sum(1) / (qh * q.double()).sum(1).clamp_min(1e-300)).float()


def _trellis_quantizer(c, L: int, bits: int, V: int, chunk_tiles: int):
    def quantize(targets: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        states, _ = viterbi(targets, c, L, bits, V, tail_biting=True, chunk_tiles=chunk_tiles)
        return c(states).reshape(targets.shape), states

    return quantize


def _select_mulbal_h(
    X: Tensor, H: Tensor, tile: int, bits: int, L, V, candidates, proxy_tiles: int, seed: int
):
    """The MUL-BAL generator with the lowest proxy error ``tr(E H Eᵀ)`` (after an ``H``-metric affine fit) of
    BlockLDLQ on ``ceil(proxy_tiles / T)`` random whole groups of ``G`` rows (the unit of the tile layout)."""
    m, n = X.shape
    span = n * tile // math.gcd(n, tile)
    G, T = span // n, span // tile
    groups = -(-m // G)
    g = torch.Generator().manual_seed(seed)
    picked = torch.randperm(groups, generator=g)[: max(1, -(-proxy_tiles // T))]
    rows = torch.cat([torch.arange(i * G, min((i + 1) * G, m)) for i in picked.tolist()])
    sub = X[rows]
    best, errors = None, {}
    for mult, shift in candidates:
        code = MulBalCode(V=V, multiplier=mult, shift=shift)
        gval, _ = block_ldlq(sub, H, _trellis_quantizer(code, L, bits, V, 32), tile)
        alpha, beta = _affine_fit_h(gval, sub, H)
        E = alpha * gval.double() + beta - sub.double()
        err = float(((E @ H) * E).sum()) / sub.numel()
        errors[(mult, shift)] = err
        if best is None or err < best[0]:
            best = (err, code.with_affine(alpha, beta))
    return best[1], errors


def _quantize_ldlq(
    W,
    code,
    bits,
    L,
    V,
    seed,
    tile,
    incoherence,
    proxy_tiles,
    candidates,
    chunk_tiles,
    hessian,
    damp,
    ldlq_block,
) -> QuantizedMatrix:
    _check_args(W, code, bits)
    m, n = W.shape
    if hessian.shape != (n, n):
        raise ValueError(
            f"hessian must be [{n}, {n}] for W of shape {tuple(W.shape)}, got {tuple(hessian.shape)}"
        )
    if not torch.isfinite(hessian).all():
        raise ValueError("hessian has non-finite entries")
    seed_out, seed_in = 2 * seed, 2 * seed + 1
    Wt = W.detach().float()
    H = damp_hessian(hessian, damp)
    if incoherence:
        Wt = incoherence_process(Wt, seed_out, seed_in)
        H = incoherence_hessian(H, seed_in)
    common = dict(
        shape=(m, n),
        bits=bits,
        L=L,
        V=V,
        tile=tile,
        seed_out=seed_out,
        seed_in=seed_in,
        incoherence=incoherence,
    )
    if code == "rtn":
        block = 1 if ldlq_block is None else ldlq_block
        levels, offset = 1 << bits, ((1 << bits) - 1) / 2
        _, step = _rtn(Wt, bits)
        step_pad = torch.cat([step, step.new_ones(1)])

        def rtn(targets: Tensor, rows: Tensor) -> tuple[Tensor, None]:
            s = step_pad[rows.clamp_max(m)]
            idx = torch.clamp(torch.round(targets / s + offset), 0, levels - 1)
            return (idx - offset) * s, None

        W_hat, _ = block_ldlq(Wt, H, rtn, block)
        idx = torch.clamp(torch.round(W_hat / step.unsqueeze(1) + offset), 0, levels - 1).to(torch.int64)
        qm = QuantizedMatrix(
            packed=pack_chunks(_tiles(idx, tile), bits),
            scales=step.float(),
            code="rtn",
            code_params={},
            **common,
        )
        q_scaled = (idx - offset) * step.unsqueeze(1)
    else:
        if ldlq_block not in (None, tile):
            raise ValueError(f"the trellis codes quantise whole tiles: ldlq_block must be None or {tile}")
        if tile % V != 0:
            raise ValueError(f"tile={tile} must be a multiple of V={V}")
        rms = Wt.pow(2).mean(1).sqrt().clamp_min(1e-12)
        X = Wt / rms.unsqueeze(1)
        params: dict = {}
        if code == "proteus":
            c, errors = _select_mulbal_h(X, H, tile, bits, L, V, candidates, proxy_tiles, seed)
            params["proxy_errors"] = errors
        else:
            c = make_code(code, V=V)
        _, states = block_ldlq(X, H, _trellis_quantizer(c, L, bits, V, chunk_tiles), tile)
        n_tiles = states.shape[0]
        if code == "proteus":
            raw = MulBalCode(V=V, multiplier=c.multiplier, shift=c.shift)(states).reshape(n_tiles, tile)
            c = c.with_affine(*_affine_fit_h(_untile(raw, (m, n)), X, H))
        q = _untile(c(states).reshape(n_tiles, tile), (m, n))
        scales = _scales_h(Wt, q, H)
        params.update(c.params())
        qm = QuantizedMatrix(
            packed=pack(states, L, bits, V), scales=scales, code=code, code_params=params, **common
        )
        q_scaled = q * scales.unsqueeze(1)
    E = q_scaled.double() - Wt.double()
    err = float(((E @ H) * E).sum())
    qm.stats = {
        "proxy_error": err,
        "proxy_relative": err / max(float(((Wt.double() @ H) * Wt.double()).sum()), 1e-300),
    }
    return qm


def _rebuild_code(qm: QuantizedMatrix):
    p = {k: v for k, v in qm.code_params.items() if k != "proxy_errors"}
    return make_code(qm.code, **p)


def decode_normalized(qm: QuantizedMatrix, *, affine: bool = True) -> Tensor:
    """The decoded code values ``q [m, n]`` (float32) in normalised units, before the per-row scales.

    ``affine=False`` drops Proteus's per-layer affine (returns the raw MUL-BAL ``g(s)``, so that
    ``q = α g + β``); the other codes have no affine and ignore it. RTN returns the centred levels
    ``j − (2^bits − 1)/2``.
    """
    if qm.code == "rtn":
        return _untile(rtn_levels(qm.packed, qm.tile, qm.bits), qm.shape)
    code = _rebuild_code(qm)
    if not affine and isinstance(code, MulBalCode):
        code = code.with_affine(1.0, 0.0)
    return _untile(decode_packed(qm.packed, code, qm.L, qm.bits, qm.V, n=qm.tile), qm.shape)


def dequantize(qm: QuantizedMatrix) -> Tensor:
    """``Ŵ [m, n]`` (float32) from a :class:`QuantizedMatrix`."""
    Wt = decode_normalized(qm) * qm.scales.unsqueeze(1)
    if qm.incoherence:
        return incoherence_unprocess(Wt, qm.seed_out, qm.seed_in)
    return Wt
