r"""Whole-model trellis quantisation, its optional distillation, and safetensors save / load.

:func:`quantize_model` replaces every ``nn.Linear`` of a model (except names in ``skip``; embeddings are not
``nn.Linear`` and are never touched) by a :class:`~.linear.TrellisLinear`, rounded data-free or, with
``rounding="ldlq"``, layer by layer by BlockLDLQ under proxy Hessians from calibration data (:mod:`.ldlq`,
:func:`quantize_layer`), optionally followed by the few-shot distillation of :mod:`.distill`
(:func:`distill_quantized`). :func:`save_quantized` writes ``config.json`` (the
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
from torch import Tensor, nn

from .distill import _batches, distill_affine
from .ldlq import DEFAULT_DAMP, HessianCollector
from .linear import TrellisLinear, _set_module
from .quantize import quantize_matrix

__all__ = ["distill_quantized", "load_quantized", "quantize_layer", "quantize_model", "save_quantized"]

_METHODS = ("proteus", "qtip-1mad", "qtip-3inst", "rtn")
_ROUNDINGS = ("data-free", "ldlq")
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
    rounding: str = "data-free",
    damp: float = DEFAULT_DAMP,
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
    ``distill_lr`` (``distill_steps=0``: no distillation). The packed bits never change.

    ``rounding="data-free"`` (default) encodes every weight without data. ``rounding="ldlq"`` (needs
    ``calibration``) is layer-sequential Hessian-aware rounding: the inputs of the first decoder layer (the
    largest ``nn.ModuleList`` holding target linears, e.g. ``model.model.layers``) are captured for the calibration
    batches, and layer by layer the proxy Hessians of its linears are collected from those inputs
    (:class:`~.ldlq.HessianCollector`), every linear is rounded by BlockLDLQ under its Hessian damped by ``damp``
    (:func:`~.quantize.quantize_matrix` with ``hessian=``), and the quantised layer's outputs become the next
    layer's inputs (one layer's activations of the calibration set in memory at a time). Target linears outside
    the decoder layers are encoded data-free. The per-layer proxy errors ``tr(ΔW H ΔWᵀ)`` (absolute and relative
    to ``tr(W H Wᵀ)``) are recorded in ``model.trellis_quantization["proxy"]``. The quantisation method is
    recorded on the model as ``model.trellis_quantization`` for :func:`save_quantized` (with the distillation KL
    before/after).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if rounding == "ldlq" and calibration is None:
        raise ValueError("rounding='ldlq' needs calibration sequences for the Hessians")
    if distill_steps < 0:
        raise ValueError(f"distill_steps must be non-negative, got {distill_steps}")
    distill = calibration is not None and distill_steps > 0
    teacher = copy.deepcopy(model) if distill else None
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not _skipped(name, skip)
    ]
    seeds = {name: seed + i for i, (name, _) in enumerate(targets)}
    kw = dict(code=method, bits=bits, L=L, V=V, **quantize_kwargs)
    proxy: dict[str, dict] = {}
    if rounding == "ldlq":
        proxy = _quantize_sequential(model, dict(targets), seeds, _batches(calibration), damp, kw)
    for name, mod in targets:
        if name in proxy:
            continue
        q = TrellisLinear.from_linear(mod, seed=seeds[name], **kw)
        _set_module(model, name, q.to(mod.weight.device))
    model.trellis_quantization = {"method": method, "bits": bits, "L": L, "V": V, "rounding": rounding}
    if rounding == "ldlq":
        model.trellis_quantization.update(damp=damp, proxy=proxy)
    if teacher is not None:
        distill_quantized(model, teacher, calibration, tune=distill_tune, steps=distill_steps, lr=distill_lr)
    return model


def _decoder_layers(model: nn.Module, targets: dict[str, nn.Module]) -> tuple[str, nn.ModuleList]:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            inside = sum(t.startswith(name + ".") for t in targets)
            if inside and (best is None or inside > best[0]):
                best = (inside, name, mod)
    if best is None:
        raise ValueError("rounding='ldlq' needs the target linears inside an nn.ModuleList of decoder layers")
    return best[1], best[2]


class _Captured(Exception):
    pass


def _layer_output(out):
    return out[0] if isinstance(out, tuple | list) else out


def quantize_layer(
    layer: nn.Module,
    inputs: list[tuple[Tensor, dict]],
    linears: dict[str, nn.Linear],
    seeds: dict[str, int],
    masks: list[Tensor | None] | None = None,
    damp: float = DEFAULT_DAMP,
    **quantize_kwargs,
) -> dict[str, dict]:
    """BlockLDLQ-quantise the ``linears`` of one decoder ``layer`` in place, Hessians from its ``inputs``.

    ``inputs``: the layer's calibration inputs, one ``(hidden_states, kwargs)`` per batch (``layer(h, **kwargs)``
    is called on each; ``masks`` gives each batch's attended tokens). ``linears``: ``{name relative to layer:
    module}``; ``seeds``: each one's Hadamard seed; ``quantize_kwargs`` go to :func:`~.quantize.quantize_matrix`
    (``code``, ``bits``, ``L``, ...). Returns ``{name: {"proxy_error", "proxy_relative"}}``.
    """
    masks = masks if masks is not None else [None] * len(inputs)
    with torch.no_grad(), HessianCollector(linears) as hc:
        for (h, kw), mask in zip(inputs, masks, strict=True):
            hc.batch(mask)
            layer(h, **kw)
        hessians = hc.hessians()
    report = {}
    for name, mod in linears.items():
        if name not in hessians:
            raise ValueError(f"{name} saw no calibration tokens")
        qm = quantize_matrix(
            mod.weight.detach(), seed=seeds[name], hessian=hessians[name], damp=damp, **quantize_kwargs
        )
        _set_module(layer, name, TrellisLinear(qm, mod.bias).to(mod.weight.device))
        report[name] = dict(qm.stats)
    return report


def _quantize_sequential(model, targets, seeds, batches, damp, kw) -> dict[str, dict]:
    """Layer-sequential BlockLDLQ of the target linears inside the decoder layers (see :func:`quantize_model`)."""
    prefix, layers = _decoder_layers(model, targets)
    captured: list[tuple[Tensor, dict]] = []

    def grab(module, args, kwargs):
        captured.append((args[0] if args else kwargs.pop("hidden_states"), dict(kwargs)))
        raise _Captured

    device = next(model.parameters()).device
    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
                except _Captured:
                    pass
    finally:
        handle.remove()
    masks = [b["attention_mask"] for b in batches]
    report: dict[str, dict] = {}
    for i, layer in enumerate(layers):
        base = f"{prefix}.{i}."
        linears = {name[len(base) :]: mod for name, mod in targets.items() if name.startswith(base)}
        if linears:
            rel_seeds = {name: seeds[base + name] for name in linears}
            for name, stats in quantize_layer(layer, captured, linears, rel_seeds, masks, damp, **kw).items():
                report[base + name] = stats
        with torch.no_grad():
            captured = [(_layer_output(layer(h, **kwargs)), kwargs) for h, kwargs in captured]
    return report


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
