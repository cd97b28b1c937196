r"""Computed ("lookup-free") trellis codes: an ``L``-bit trellis state ``s`` → ``V`` approximately N(0, 1) values.

A bitshift trellis quantizer (:mod:`.trellis`) stores, per weight, only the ``k`` new bits of a state; the
reconstruction of a state is a *code* ``c(s) ∈ ℝ^V``. With ``L = 16`` a lookup table would have 2^16 entries
per layer; the codes here compute ``c(s)`` with a few integer instructions instead (the decoder needs no
table; the encoder's Viterbi may precompute ``c`` on all ``2^L`` states, :meth:`TrellisCode.table`).

All arithmetic is on int64 tensors holding unsigned 32-bit values (products of a 32-bit constant and a
32-bit value fit in 63 bits), so every code is exact, deterministic and vectorised over any state shape.
``__call__(states)`` returns float32 values of shape ``states.shape + (V,)``. The integer steps and values
are the decode primitives of :mod:`lightning_llm.kernels.trellis_decode`, which the trellis matmul decodes
with, so encoder and decoder share one definition.

QTIP "1MAD" (one multiply-add; Tseng et al. 2024, "QTIP: Quantization with Trellises and Incoherence
Processing")::

    x = (34038481 · s + 76625530) mod 2^32
    c(s) = (byte0(x) + byte1(x) + byte2(x) + byte3(x) − 510) / 147.8

The sum of four uniform bytes has mean 510 and standard deviation ``sqrt(4 (256² − 1)/12) ≈ 147.8``, so
``c`` is centred, unit-variance and close to Gaussian (CLT over 4 terms, bounded at ±3.45).

QTIP "3INST" (three instructions: LCG step, mask-and-xor, reinterpretation as two fp16)::

    x = (1664525 · s + 1013904223) mod 2^32            (Numerical Recipes LCG constants: our choice)
    y = (x AND 0x8FFF8FFF) XOR 0x3B603B60
    c(s) = (fp16(y[31:16]) + fp16(y[15:0])) / 1.2444

Per 16-bit half the mask keeps the sign bit, the two low exponent bits and the mantissa; the xor fixes the
three high exponent bits to ``011``, so each half is ``±2^(e−15)·(1 + m)`` with ``e ∈ {12, …, 15}``, a
symmetric heavy-ish distribution on ``±[0.125, 2)``. The sum of the two halves has excess kurtosis ≈ −0.12
(measured over all 2^16 states: kurtosis 2.88, range ±3.2σ). ``1.2444`` is its standard deviation over
uniform 32-bit ``x`` (measured), so ``c`` has unit variance.

Proteus "MUL-BAL" (lookup-free generator with a balanced byte sum and a per-layer affine Gaussianizer)::

    x = (a · s) mod 2^32                    a odd (the multiplier)
    x = x XOR (x >> r)                      xor-shift mixing (r the shift)
    g(s) = (byte0 − byte1 + byte2 − byte3) / 147.8      balanced: mean 0 without an offset constant
    c(s) = α · g(s) + β                     α, β fitted per layer by least squares

The exact Proteus specifics are unverified (docs/methods.md §13 says so); what is implemented is the description
above, with ``(a, r)`` chosen per layer from :data:`MULBAL_CANDIDATES` (8 pairs) by the proxy error of
quantising a subsample of that layer's incoherence-processed weights (:func:`lightning_llm.quantization.
quantize_matrix`). The alternating-sign byte sum is centred by construction (no ``−510``), and the xor-shift
makes the low bytes depend on the high bits of the product (a plain multiply leaves byte 0 a function of the
low 8 bits of ``s`` only).

``V = 2``: value ``j`` (``j = 0, 1``) is computed from the ``(j+1)``-th iterate of the code's first integer
step (``x_0 = step(s)``, ``x_1 = step(x_0)``), i.e. two chained LCG / multiply steps; all other instructions
are unchanged. This is our choice (QTIP's V = 2 variants are not reproduced here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_llm.kernels.trellis_decode import (
    THREEINST_MASK,
    THREEINST_STD,
    THREEINST_XOR,
    mulbal_step,
    mulbal_value,
    onemad_step,
    onemad_value,
    threeinst_value,
)

__all__ = [
    "MULBAL_CANDIDATES",
    "MulBalCode",
    "OneMADCode",
    "TableCode",
    "ThreeInstCode",
    "TrellisCode",
    "make_code",
]

#: Proteus MUL-BAL candidate pool: (odd multiplier, xor-shift). Multipliers are well-known odd 32-bit mixing
#: constants (Knuth's golden-ratio multiplier, murmur3/xxhash primes, QTIP's 1MAD multiplier, an LCG one).
MULBAL_CANDIDATES: tuple[tuple[int, int], ...] = (
    (0x9E3779B1, 16),
    (0x85EBCA6B, 13),
    (0xC2B2AE35, 16),
    (0x27D4EB2F, 15),
    (0x165667B1, 13),
    (34038481, 16),
    (0x2545F491, 11),
    (1664525, 17),
)


def _check_states(states: Tensor) -> Tensor:
    if states.dtype.is_floating_point or states.dtype == torch.bool:
        raise ValueError(f"states must be an integer tensor, got {states.dtype}")
    return states.to(torch.int64)


@dataclass(frozen=True)
class TrellisCode:
    """Base class: a deterministic map from integer states to ``V`` float values."""

    V: int = 1

    def __post_init__(self) -> None:
        if self.V not in (1, 2):
            raise ValueError(f"V must be 1 or 2, got {self.V}")

    def _value(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _step(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, states: Tensor) -> Tensor:
        x = _check_states(states)
        out = []
        for _ in range(self.V):
            x = self._step(x)
            out.append(self._value(x))
        return torch.stack(out, dim=-1)

    def table(self, L: int, device: torch.device | str | None = None) -> Tensor:
        """``c(s)`` for all ``2^L`` states, shape ``[2^L, V]`` (the encoder's precomputation only)."""
        return self(torch.arange(1 << L, device=device))

    def params(self) -> dict:
        """The constants that define the code (stored with a quantized matrix)."""
        return {"V": self.V}


@dataclass(frozen=True)
class OneMADCode(TrellisCode):
    """QTIP 1MAD: one multiply-add mod 2^32, then the centred sum of the 4 bytes."""

    a: int = 34038481
    b: int = 76625530

    def _step(self, x: Tensor) -> Tensor:
        return onemad_step(x, self.a, self.b)

    def _value(self, x: Tensor) -> Tensor:
        return onemad_value(x)

    def params(self) -> dict:
        return {"V": self.V, "a": self.a, "b": self.b}


@dataclass(frozen=True)
class ThreeInstCode(TrellisCode):
    """QTIP-style 3INST: LCG step, mask + xor, sum of the two halves read as fp16 (unit variance)."""

    a: int = 1664525
    b: int = 1013904223
    mask: int = THREEINST_MASK
    xor: int = THREEINST_XOR
    std: float = THREEINST_STD

    def _step(self, x: Tensor) -> Tensor:
        return onemad_step(x, self.a, self.b)

    def _value(self, x: Tensor) -> Tensor:
        return threeinst_value(x, self.mask, self.xor, self.std)

    def params(self) -> dict:
        return {"V": self.V, "a": self.a, "b": self.b, "mask": self.mask, "xor": self.xor, "std": self.std}


@dataclass(frozen=True)
class MulBalCode(TrellisCode):
    """Proteus-style MUL-BAL: odd multiply, xor-shift, balanced byte sum, affine ``alpha·g + beta``."""

    multiplier: int = 0x9E3779B1
    shift: int = 16
    alpha: float = 1.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.multiplier % 2 == 0 or not 0 < self.multiplier < (1 << 32):
            raise ValueError(f"multiplier must be an odd 32-bit integer, got {self.multiplier}")
        if not 0 < self.shift < 32:
            raise ValueError(f"shift must be in [1, 31], got {self.shift}")

    def _step(self, x: Tensor) -> Tensor:
        return mulbal_step(x, self.multiplier, self.shift)

    def _value(self, x: Tensor) -> Tensor:
        return mulbal_value(x, self.alpha, self.beta)

    def with_affine(self, alpha: float, beta: float) -> MulBalCode:
        return MulBalCode(V=self.V, multiplier=self.multiplier, shift=self.shift, alpha=alpha, beta=beta)

    def params(self) -> dict:
        return {
            "V": self.V,
            "multiplier": self.multiplier,
            "shift": self.shift,
            "alpha": self.alpha,
            "beta": self.beta,
        }


class TableCode:
    """An explicit lookup table ``[2^L, V]`` (tests and reference only: *not* lookup-free)."""

    def __init__(self, table: Tensor) -> None:
        if table.dim() != 2:
            raise ValueError(f"table must have shape [2^L, V], got {tuple(table.shape)}")
        self._table = table.float()
        self.V = table.shape[1]

    def __call__(self, states: Tensor) -> Tensor:
        return self._table[_check_states(states)]

    def table(self, L: int, device: torch.device | str | None = None) -> Tensor:
        if self._table.shape[0] != 1 << L:
            raise ValueError(f"table has {self._table.shape[0]} rows, expected 2^L = {1 << L}")
        return self._table.to(device)

    def params(self) -> dict:
        return {"V": self.V, "table": self._table}


def make_code(name: str, V: int = 1, **params) -> TrellisCode:
    """Build a code by name: ``"qtip-1mad"``, ``"qtip-3inst"`` or ``"proteus"`` (MUL-BAL)."""
    params = {k: v for k, v in params.items() if k != "V"}
    if name == "qtip-1mad":
        return OneMADCode(V=V, **params)
    if name == "qtip-3inst":
        return ThreeInstCode(V=V, **params)
    if name == "proteus":
        return MulBalCode(V=V, **params)
    raise ValueError(f"unknown code {name!r}; expected 'qtip-1mad', 'qtip-3inst' or 'proteus'")
