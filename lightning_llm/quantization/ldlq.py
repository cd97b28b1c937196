r"""Hessian-aware rounding: proxy Hessians from calibration inputs and BlockLDLQ (QuIP# / QTIP).

For a linear layer ``y = W x`` the proxy loss of a rounding ``Ŵ`` is ``tr((Ŵ − W) H (Ŵ − W)ᵀ)`` with
``H = E[x xᵀ]`` over calibration tokens (:class:`HessianCollector`: forward pre-hooks, a running sum
``Σ x xᵀ`` and a token count per distinct input, so layers fed the same tensor, such as ``q/k/v`` or
``gate/up``, share one ``H``; memory ``O(n²)`` per distinct input, never the activations).
:func:`damp_hessian` adds ``λ · mean(diag H) · I`` (``λ = 0.01`` by default, QuIP#'s and QTIP's
``sigma_reg``); :func:`incoherence_hessian` rotates ``H`` by the same input-side Hadamard as ``W``
(``H̃ = (Q_n S_n) H (Q_n S_n)ᵀ``, so ``tr(ΔW̃ H̃ ΔW̃ᵀ) = tr(ΔW H ΔWᵀ)``).

:func:`block_ldlq` rounds ``X [m, n]`` under ``H [n, n]``. Write ``H = M D Mᵀ`` with ``M`` block *unit upper*
triangular and ``D`` block diagonal (:func:`feedback_factor`). With ``E = Ŵ − X`` the loss is
``Σ_k (E M)_k D_k (E M)_kᵀ`` and ``(E M)_k = E_k + Σ_{j<k} E_j M_{jk}``, so quantising the column blocks left
to right with the targets ``x_k = X_k − Σ_{j<k} E_j M_{jk}`` makes ``(E M)_k = Q(x_k) − x_k``, the block
quantiser's own error: the error of the earlier blocks is fed forward through the LDL factor.

The blocks follow the stored layout. A quantised matrix is flattened row-major and cut into tiles of
``block`` weights (the trellis tile, 256 by default), so a tile may hold the tail of one row and the head of
the next. Rows are independent under the proxy loss, so each row only needs its own columns in tile order:
row ``i`` is cut at the tile boundaries that fall inside it, which depends only on the row's *phase*
``i mod G`` (``G = lcm(n, block) / n`` rows make a whole number ``T = lcm(n, block) / block`` of tiles), and
each phase gets the factor ``M`` of its own column partition. Round ``r = 0 … T − 1`` quantises tile ``r`` of
every group of ``G`` rows at once (a batch of tiles for the Viterbi): all earlier columns of the rows it
touches lie in earlier rounds. For ``n`` a multiple of ``block`` this is the usual BlockLDLQ with column blocks
of ``block`` (one row per tile); ``block = 1`` is the column-by-column LDLQ (scalar quantisers).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_llm.kernels.hadamard import RandomHadamard

__all__ = [
    "DEFAULT_DAMP",
    "HessianCollector",
    "block_ldlq",
    "damp_hessian",
    "feedback_factor",
    "incoherence_hessian",
    "proxy_error",
]

#: Relative damping ``λ`` of :func:`damp_hessian` (QuIP#'s and QTIP's ``sigma_reg`` default).
DEFAULT_DAMP = 0.01


def damp_hessian(H: Tensor, damp: float = DEFAULT_DAMP) -> Tensor:
    """``H + damp · mean(diag H) · I`` (float64); a zero ``H`` becomes ``damp · I``."""
    if H.dim() != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H must be a square matrix, got shape {tuple(H.shape)}")
    if damp < 0:
        raise ValueError(f"damp must be non-negative, got {damp}")
    H = H.detach().double()
    scale = float(H.diagonal().mean())
    if not scale > 0:
        scale = 1.0
    return H + damp * scale * torch.eye(H.shape[0], dtype=H.dtype, device=H.device)


def incoherence_hessian(H: Tensor, seed_in: int) -> Tensor:
    """``H̃ = (Q_n S_n) H (Q_n S_n)ᵀ``, the Hessian of the rotated inputs ``x̃ = Q_n S_n x``."""
    rh = RandomHadamard(H.shape[0], seed_in)
    return rh(rh(H).t()).t()


def proxy_error(W_hat: Tensor, W: Tensor, H: Tensor) -> float:
    """``tr((Ŵ − W) H (Ŵ − W)ᵀ)``."""
    E = (W_hat.double() - W.double()).to(H.device)
    return float(((E @ H.double()) * E).sum())


def _row_bounds(n: int, block: int, phase: int) -> list[int]:
    """Column boundaries of a row whose first weight sits at flat offset ``phase · n`` of its group."""
    start = phase * n
    cuts = range((start // block + 1) * block, start + n, block)
    return [0, *(c - start for c in cuts), n]


def feedback_factor(H: Tensor, bounds: list[int]) -> Tensor:
    """``M`` with ``H = M D Mᵀ`` (``M`` block unit upper triangular for the column partition ``bounds``, ``D``
    block diagonal), returned with its diagonal blocks zeroed: the feed-forward weights of :func:`block_ldlq`."""
    H = H.double()
    R = torch.linalg.cholesky(H.flip(0, 1)).flip(0, 1)  # upper triangular, H = R Rᵀ
    M = torch.zeros_like(H)
    for a, b in itertools.pairwise(bounds):
        M[:a, a:b] = torch.linalg.solve_triangular(R[a:b, a:b], R[:a, a:b], upper=True, left=False)
    return M


QuantizeTiles = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


def block_ldlq(X: Tensor, H: Tensor, quantize: QuantizeTiles, block: int) -> tuple[Tensor, Tensor | None]:
    """BlockLDLQ of ``X [m, n]`` under ``H [n, n]`` in the row-major tile layout (see the module docstring).

    ``quantize(targets, rows)`` gets a batch of tiles ``targets [g, block]`` (float32; entries past the last
    row are 0) and the row of ``X`` each entry belongs to (``rows [g, block]``, int64, ``≥ m`` in the padding)
    and returns the quantised values ``[g, block]`` and an optional per-tile payload ``[g, ...]`` (the trellis
    states). Returns ``Ŵ [m, n]`` (float32) and the payloads of the ``ceil(m·n / block)`` tiles in tile order
    (``None`` if ``quantize`` returns none).
    """
    if X.dim() != 2 or H.shape != (X.shape[1], X.shape[1]):
        raise ValueError(f"X must be [m, n] and H [n, n]; got {tuple(X.shape)} and {tuple(H.shape)}")
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    m, n = X.shape
    span = n * block // math.gcd(n, block)
    G, T = span // n, span // block  # rows per group, tiles per group
    groups = -(-m // G)
    Xp = X.new_zeros(groups * G, n, dtype=torch.float64)
    Xp[:m] = X.double()
    E = torch.zeros_like(Xp)  # Ŵ − X, filled round by round
    factors: dict[int, Tensor] = {}
    payloads: list[Tensor | None] = []
    base = torch.arange(groups) * G
    for r in range(T):
        lo, hi = r * block, (r + 1) * block
        segments = []
        for p in range(lo // n, (hi - 1) // n + 1):
            a, b = max(lo - p * n, 0), min(hi - p * n, n)
            rows = base + p
            x = Xp[rows, a:b]
            if a > 0:
                if p not in factors:
                    factors[p] = feedback_factor(H, _row_bounds(n, block, p))
                x = x - E[rows, :a] @ factors[p][:a, a:b]
            x[rows >= m] = 0.0
            segments.append((rows, a, b, x))
        targets = torch.cat([s[3] for s in segments], dim=1).float()
        row_ids = torch.cat([s[0].unsqueeze(1).expand(-1, s[2] - s[1]) for s in segments], dim=1)
        values, payload = quantize(targets, row_ids)
        values = values.double()
        off = 0
        for rows, a, b, _ in segments:
            E[rows, a:b] = values[:, off : off + b - a] - Xp[rows, a:b]
            off += b - a
        payloads.append(payload)
    W_hat = (E[:m] + Xp[:m]).float()
    if payloads[0] is None:
        return W_hat, None
    # payloads[r][g] is tile g·T + r
    stacked = torch.stack(payloads, dim=1).reshape(groups * T, *payloads[0].shape[1:])
    return W_hat, stacked[: -(-m * n // block)]


class HessianCollector:
    """Running ``Σ x xᵀ`` of the inputs of some ``nn.Linear`` modules, one per distinct input tensor.

    ``with HessianCollector(linears) as hc:`` registers forward pre-hooks on ``linears`` (``{name: module}``);
    every forward adds the module's input tokens to its sum, except that a module fed the very tensor object
    another module already got in the same :meth:`batch` shares that module's sum (``q/k/v``, ``gate/up``).
    ``hc.batch(mask)`` starts a batch (``mask [..]``, 1 for the tokens to count, matching the inputs' leading
    dimensions; None counts all). :meth:`hessians` returns ``{name: Σ x xᵀ / tokens}`` (float64).
    """

    def __init__(self, linears: dict[str, nn.Module]) -> None:
        self.linears = dict(linears)
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.shared: dict[str, str] = {}
        self._seen: list[tuple[Tensor, str]] = []
        self._mask: Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> HessianCollector:
        for name, module in self.linears.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()

    def batch(self, mask: Tensor | None = None) -> None:
        """Start a new forward batch (tensor identity for sharing is tracked within a batch only)."""
        self._seen.clear()
        self._mask = None if mask is None else mask.reshape(-1).bool()

    def _hook(self, name: str):
        def hook(module, args):
            x = args[0]
            for seen, owner in self._seen:
                if seen is x:
                    self.shared.setdefault(name, owner)
                    return
            self._seen.append((x, name))
            flat = x.detach().reshape(-1, x.shape[-1]).double()
            if self._mask is not None and self._mask.numel() == flat.shape[0]:
                flat = flat[self._mask.to(flat.device)]
            if name not in self.sums:
                self.sums[name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64)
                self.counts[name] = 0
            self.sums[name] += (flat.t() @ flat).cpu()
            self.counts[name] += flat.shape[0]

        return hook

    def hessians(self) -> dict[str, Tensor]:
        """``{name: E[x xᵀ]}`` for every hooked module that saw at least one token."""
        out = {}
        for name in self.linears:
            owner = self.shared.get(name, name)
            if owner in self.sums and self.counts[owner] > 0:
                out[name] = self.sums[owner] / self.counts[owner]
        return out
