r"""Whole-model trellis quantisation, its optional distillation, and safetensors save / load.

:func:`quantize_model` replaces every ``nn.Linear`` of a model (except names in ``skip``; embeddings are not
``nn.Linear`` and are never touched) by a :class:`~.linear.TrellisLinear`, optionally followed by the few-shot
distillation of :mod:`.distill` (:func:`distill_quantized`). :func:`save_quantized` writes ``config.json`` (the
model's Hugging Face config), ``quantization.json`` (method and each layer's metadata) and
``model.safetensors`` (every parameter and buffer, quantised layers included; no pickle);
:func:`load_quantized` rebuilds the architecture from the config, swaps in empty
:class:`~.linear.TrellisLinear` modules and loads the tensors.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from .distill import distill_affine
from .linear import TrellisLinear, _set_module

__all__ = ["distill_quantized", "load_quantized", "quantize_model", "save_quantized"]

_METHODS = ("proteus", "qtip-1mad", "qtip-3inst", "rtn")
_QUANT_CONFIG = "quantization.json"
_WEIGHTS = "model.safetensors"


def _skipped(name: str, skip) -> bool:
    return any(s == name or name.endswith("." + s) or s in name.split(".") for s in skip)


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
