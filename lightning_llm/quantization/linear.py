r"""Trellis-quantised linear layers.

:class:`TrellisLinear` holds one :class:`~.quantize.QuantizedMatrix` as buffers (``packed`` uint8 bits,
``scales`` fp32, ``code_ints`` = the code's integer constants ``(c0, c1)`` int64 and ``code_floats`` = its
affine ``(α, β)`` fp64) plus an optional ``bias``; the decode metadata (code name, ``L``, bits, ``V``, tile,
Hadamard seeds, shape) are plain attributes (:meth:`TrellisLinear.meta`, written to a JSON config by
:func:`~.model.save_quantized`). ``forward`` calls :func:`lightning_llm.kernels.trellis_matmul` (Hadamards on
the activations in PyTorch, the weight decoded inside the Triton kernel on CUDA, the decode-then-matmul
reference elsewhere); :func:`set_trellis_backend` picks that op's backend for a whole model. The RTN baseline
is the same module with ``code="rtn"`` (reference path only).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_llm.kernels.trellis_matmul import BACKENDS, code_constants, trellis_matmul

from .quantize import QuantizedMatrix, quantize_matrix

__all__ = ["TrellisLinear", "set_trellis_backend"]


class TrellisLinear(nn.Module):
    """``y = x Ŵᵀ + b`` with ``Ŵ`` stored trellis-quantised (see the module docstring)."""

    def __init__(self, qm: QuantizedMatrix, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qm.shape
        self.code = qm.code
        self.code_params = {k: v for k, v in qm.code_params.items() if k != "proxy_errors"}
        self.L, self.bits, self.V, self.tile = qm.L, qm.bits, qm.V, qm.tile
        self.seed_out, self.seed_in, self.incoherence = qm.seed_out, qm.seed_in, qm.incoherence
        _, c0, c1, alpha, beta = code_constants(self.code, self.code_params)
        self.register_buffer("packed", qm.packed.clone())
        self.register_buffer("scales", qm.scales.detach().float().clone())
        self.register_buffer("code_ints", torch.tensor([c0, c1], dtype=torch.int64))
        self.register_buffer("code_floats", torch.tensor([alpha, beta], dtype=torch.float64))
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.backend = "auto"  # the op's backend (a runtime choice, not saved): see set_trellis_backend

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        code: str = "proteus",
        bits: int = 2,
        L: int = 16,
        V: int = 1,
        seed: int = 0,
        **kw,
    ) -> TrellisLinear:
        """Quantise ``linear.weight`` with :func:`quantize_matrix` and keep its bias."""
        qm = quantize_matrix(linear.weight.detach(), code=code, bits=bits, L=L, V=V, seed=seed, **kw)
        return cls(qm, linear.bias)

    @classmethod
    def from_meta(cls, meta: dict) -> TrellisLinear:
        """An empty module (zero buffers of the right shapes) for :func:`load_quantized` to fill."""
        m, n = meta["shape"]
        tiles = -(-m * n // meta["tile"])
        qm = QuantizedMatrix(
            packed=torch.zeros(tiles, -(-meta["tile"] * meta["bits"] // 8), dtype=torch.uint8),
            scales=torch.zeros(m),
            shape=(m, n),
            code=meta["code"],
            code_params=meta["code_params"],
            bits=meta["bits"],
            L=meta["L"],
            V=meta["V"],
            tile=meta["tile"],
            seed_out=meta["seed_out"],
            seed_in=meta["seed_in"],
            incoherence=meta["incoherence"],
        )
        return cls(qm, torch.zeros(m) if meta["bias"] else None)

    def meta(self) -> dict:
        """JSON-serialisable decode metadata (the tensors live in the buffers)."""
        return {
            "shape": [self.out_features, self.in_features],
            "code": self.code,
            "code_params": self.code_params,
            "bits": self.bits,
            "L": self.L,
            "V": self.V,
            "tile": self.tile,
            "seed_out": self.seed_out,
            "seed_in": self.seed_in,
            "incoherence": self.incoherence,
            "bias": self.bias is not None,
        }

    def quantized_matrix(self) -> QuantizedMatrix:
        """The stored weight as a :class:`QuantizedMatrix` (for :func:`~.quantize.dequantize`)."""
        return QuantizedMatrix(
            packed=self.packed,
            scales=self.scales,
            shape=(self.out_features, self.in_features),
            code=self.code,
            code_params=dict(self.code_params),
            bits=self.bits,
            L=self.L,
            V=self.V,
            tile=self.tile,
            seed_out=self.seed_out,
            seed_in=self.seed_in,
            incoherence=self.incoherence,
        )

    def _apply(self, fn, recurse: bool = True):
        """As ``nn.Module._apply``, but ``scales`` / ``code_floats`` keep their dtype (device moves only).

        ``model.to(torch.bfloat16)`` would otherwise round the per-row scales (and the code's affine) to bf16;
        they are a negligible share of the bytes and the op reads them as fp32 anyway.
        """
        keep = {name: getattr(self, name) for name in ("scales", "code_floats")}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        return self

    def forward(self, x: Tensor) -> Tensor:
        y = trellis_matmul(
            x,
            self.packed,
            self.scales,
            (self.out_features, self.in_features),
            self.code,
            self.code_params,
            L=self.L,
            k=self.bits,
            V=self.V,
            tile=self.tile,
            seed_out=self.seed_out,
            seed_in=self.seed_in,
            incoherence=self.incoherence,
            _backend=self.backend,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, code={self.code}, "
            f"bits={self.bits}, L={self.L}, V={self.V}, bias={self.bias is not None}"
        )


def set_trellis_backend(model: nn.Module, backend: str) -> nn.Module:
    """Choose how every :class:`TrellisLinear` of ``model`` computes ``x Ŵᵀ``; returns ``model``.

    ``"auto"`` (default): the Triton kernel on CUDA for 1MAD / MUL-BAL, else the eager PyTorch reference (decodes
    the whole weight per call). ``"compiled"``: the reference's decode compiled with ``torch.compile`` (first
    call per layer shape compiles for seconds, then ≈ 8x faster than eager on a CPU; needs a C++ compiler on
    CPU). ``"torch"`` / ``"triton"`` force one path.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for module in model.modules():
        if isinstance(module, TrellisLinear):
            module.backend = backend
    return model


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule of ``model`` at the dotted path ``name`` by ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
