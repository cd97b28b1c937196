r"""Trellis-quantised linear layers, whole-model quantisation, and safetensors save / load.

:class:`TrellisLinear` holds one :class:`~.quantize.QuantizedMatrix` as buffers (``packed`` uint8 bits,
``scales`` fp32, ``code_ints`` = the code's integer constants ``(c0, c1)`` int64 and ``code_floats`` = its
affine ``(α, β)`` fp64) plus an optional ``bias``; the decode metadata (code name, ``L``, bits, ``V``, tile,
Hadamard seeds, shape) are plain attributes, written to a JSON config by :func:`save_quantized`. ``forward``
calls :func:`lightning_llm.kernels.trellis_matmul` (Hadamards on the activations in PyTorch, the weight decoded
inside the Triton kernel on CUDA, the decode-then-matmul reference elsewhere). The RTN baseline is the same
module with ``code="rtn"`` (reference path only).

:func:`quantize_model` replaces every ``nn.Linear`` of a model (except names in ``skip``; embeddings are not
``nn.Linear`` and are never touched) by a :class:`TrellisLinear`. :func:`save_quantized` writes
``config.json`` (the model's Hugging Face config), ``quantization.json`` (method and each layer's metadata)
and ``model.safetensors`` (every parameter and buffer, quantised layers included; no pickle);
:func:`load_quantized` rebuilds the architecture from the config, swaps in empty :class:`TrellisLinear`
modules and loads the tensors.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import Tensor, nn

from .quantize import QuantizedMatrix, quantize_matrix

__all__ = [
    "TrellisLinear",
    "distill_quantized",
    "load_quantized",
    "quantize_model",
    "save_quantized",
    "set_trellis_backend",
]

_METHODS = ("proteus", "qtip-1mad", "qtip-3inst", "rtn")
_QUANT_CONFIG = "quantization.json"
_WEIGHTS = "model.safetensors"


class TrellisLinear(nn.Module):
    """``y = x Ŵᵀ + b`` with ``Ŵ`` stored trellis-quantised (see the module docstring)."""

    def __init__(self, qm: QuantizedMatrix, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qm.shape
        self.code = qm.code
        self.code_params = {k: v for k, v in qm.code_params.items() if k != "proxy_errors"}
        self.L, self.bits, self.V, self.tile = qm.L, qm.bits, qm.V, qm.tile
        self.seed_out, self.seed_in, self.incoherence = qm.seed_out, qm.seed_in, qm.incoherence
        from lightning_llm.kernels.trellis_matmul import _code_constants

        _, c0, c1, alpha, beta = _code_constants(self.code, self.code_params)
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
        from lightning_llm.kernels.trellis_matmul import trellis_matmul

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
    from lightning_llm.kernels.trellis_matmul import _BACKENDS

    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    for module in model.modules():
        if isinstance(module, TrellisLinear):
            module.backend = backend
    return model


def _skipped(name: str, skip) -> bool:
    return any(s == name or name.endswith("." + s) or s in name.split(".") for s in skip)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_model(
    model: nn.Module,
    method: str = "proteus",
    bits: int = 2,
    L: int = 16,
    V: int = 1,
    calibration=None,
    skip=("lm_head",),
    seed: int = 0,
    distill_tune: tuple[str, ...] = ("affine", "scales"),
    distill_steps: int = 50,
    distill_lr: float = 1e-2,
    **quantize_kwargs,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`TrellisLinear`; returns ``model``.

    ``method``: ``"proteus"``, ``"qtip-1mad"``, ``"qtip-3inst"`` or ``"rtn"``. Layers whose qualified name,
    or one of its dotted components, is in ``skip`` are left alone (by default the ``lm_head``; embeddings are
    not ``nn.Linear``). Layer ``i`` (in ``named_modules`` order) uses ``seed + i`` for its Hadamards.
    ``calibration`` (token ids, a batch dict or an iterable of them; None = data-free) turns on Proteus's
    optional few-shot distillation (:func:`~.distill.distill_affine`): a full-precision copy of the model is
    kept as the teacher (twice the model's memory while quantising; call :func:`distill_quantized` with your own
    teacher to avoid the copy), and after quantisation the layers' affine statistics (``distill_tune``, by default
    ``α, β`` and the per-channel scales; RTN and the QTIP codes have no affine and tune their scales) are fitted
    to the teacher's next-token distributions on those sequences for ``distill_steps`` Adam steps at
    ``distill_lr``. The packed bits never change. The incoherence/trellis encoding itself is data-free
    (no Hessian-aware rounding). The quantisation method is recorded on the model as
    ``model.trellis_quantization`` for :func:`save_quantized` (with the distillation KL before/after).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    teacher = copy.deepcopy(model) if calibration is not None else None
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not _skipped(name, skip)
    ]
    for i, (name, mod) in enumerate(targets):
        q = TrellisLinear.from_linear(mod, code=method, bits=bits, L=L, V=V, seed=seed + i, **quantize_kwargs)
        _set_module(model, name, q.to(mod.weight.device))
    model.trellis_quantization = {"method": method, "bits": bits, "L": L, "V": V}
    if teacher is not None:
        distill_quantized(model, teacher, calibration, tune=distill_tune, steps=distill_steps, lr=distill_lr)
    return model


def distill_quantized(
    model: nn.Module,
    teacher: nn.Module,
    calibration,
    tune: tuple[str, ...] = ("affine", "scales"),
    steps: int = 50,
    lr: float = 1e-2,
) -> list[float]:
    """:func:`~.distill.distill_affine` on a model quantised by :func:`quantize_model`, recorded in its
    ``trellis_quantization`` (``"distillation"``: settings and the calibration KL before / after) so that
    :func:`save_quantized` keeps it. Returns the KL history."""
    from .distill import distill_affine

    history = distill_affine(model, teacher, calibration, tune=tune, steps=steps, lr=lr)
    record = getattr(model, "trellis_quantization", None)
    if record is None:
        record = model.trellis_quantization = {}
    record["distillation"] = {
        "tune": list(tune),
        "steps": steps,
        "lr": lr,
        "kl_before": history[0],
        "kl_after": history[-1],
    }
    return history


def save_quantized(model: nn.Module, directory: str | Path) -> Path:
    """Write ``config.json``, ``quantization.json`` and ``model.safetensors`` (no pickle) to ``directory``."""
    from safetensors.torch import save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if not hasattr(model, "config"):
        raise ValueError(
            "save_quantized needs a Hugging Face model (with .config) to rebuild the architecture"
        )
    model.config.save_pretrained(directory)
    layers = {name: mod.meta() for name, mod in model.named_modules() if isinstance(mod, TrellisLinear)}
    record = {"format": 1, **getattr(model, "trellis_quantization", {}), "layers": layers}
    (directory / _QUANT_CONFIG).write_text(json.dumps(record, indent=1, sort_keys=True))
    save_model(model, str(directory / _WEIGHTS))
    return directory


def load_quantized(directory: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """Rebuild a model written by :func:`save_quantized` (eval mode)."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory)
    record = json.loads((directory / _QUANT_CONFIG).read_text())
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_config(config)
    for name, meta in record["layers"].items():
        _set_module(model, name, TrellisLinear.from_meta(meta))
    load_model(model, str(directory / _WEIGHTS), strict=True, device=str(device))
    model.trellis_quantization = {k: v for k, v in record.items() if k not in ("layers", "format")}
    return model.to(device).eval()
