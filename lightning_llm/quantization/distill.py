r"""Few-shot distillation of a trellis-quantised model's affine statistics (Proteus, optional step).

After :func:`~.model.quantize_model` every quantised layer computes, in the incoherence-processed domain,

.. math::  \tilde W_{ij} = \sigma_i\,(\alpha\, g(s_{ij}) + \beta), \qquad \hat W = (Q_m S_m)^\top \tilde W (Q_n S_n),

with ``s`` the packed trellis states, ``g`` the code (Proteus's MUL-BAL generator), ``(α, β)`` the per-layer
affine Gaussianizer and ``σ`` the per-output-channel scales of channel compensation. Distillation keeps the
packed states (hence the bits, the decoder and the kernel) fixed and tunes only these statistics to match the
full-precision model's next-token distributions on a few calibration sequences:

.. math::  \min_{\alpha, \beta, \sigma}\ \frac{1}{|T|}\sum_{t \in T}
           \mathrm{KL}\big(p_{\text{full}}(\cdot \mid x_{<t}) \,\|\, p_{\hat W(\alpha,\beta,\sigma)}(\cdot \mid x_{<t})\big)

over the attended positions ``T`` of the calibration batches (full-batch Adam, ``steps`` passes over them).
``tune`` picks the statistics: ``"affine"`` (``α, β`` per layer; Proteus only, the QTIP codes and RTN have no
affine) and/or ``"scales"`` (``σ``, every method). The paper's exact objective and optimiser are unverified
(docs/methods.md §13); this is the plain logit-KL form.

While tuning, each :class:`~.linear.TrellisLinear` is stood in for by a dense module that rebuilds ``Ŵ`` from
the fixed ``g`` (decoded once) and the tuned tensors; the results are written back into the quantised layers
(``code_params`` / ``code_floats`` / ``scales``), so the packed bits are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .hadamard import incoherence_unprocess
from .linear import TrellisLinear, _set_module
from .quantize import decode_normalized

__all__ = ["distill_affine"]

_TUNABLE = ("affine", "scales")


class _DenseStandIn(nn.Module):
    """``Ŵ = U(σ ⊙ (α g + β))`` with ``g`` fixed, differentiable in the tuned statistics.

    The statistics are parameterised as offsets from their quantised values, zero at the start:
    ``α = α₀·e^{a}``, ``σ = σ₀·e^{c}`` (log-ratios, so one learning rate suits every layer's magnitude) and
    ``β = β₀ + b`` (``g`` has unit variance, so ``b`` is in the code's natural units).
    """

    def __init__(self, layer: TrellisLinear, tune: set[str]) -> None:
        super().__init__()
        qm = layer.quantized_matrix()
        has_affine = layer.code == "proteus"
        self.layer = layer
        self.bias = layer.bias
        self.register_buffer("g", decode_normalized(qm, affine=not has_affine))
        alpha = float(layer.code_params["alpha"]) if has_affine else 1.0
        beta = float(layer.code_params["beta"]) if has_affine else 0.0
        self.register_buffer("alpha0", torch.tensor(alpha))
        self.register_buffer("beta0", torch.tensor(beta))
        self.register_buffer("scales0", layer.scales.detach().float().clone())
        tune_affine = has_affine and "affine" in tune
        self.log_alpha = nn.Parameter(torch.zeros(()), requires_grad=tune_affine)
        self.beta_shift = nn.Parameter(torch.zeros(()), requires_grad=tune_affine)
        self.log_scales = nn.Parameter(torch.zeros_like(self.scales0), requires_grad="scales" in tune)

    def statistics(self) -> tuple[Tensor, Tensor, Tensor]:
        """Current ``(α, β, σ)``."""
        return (
            self.alpha0 * self.log_alpha.exp(),
            self.beta0 + self.beta_shift,
            self.scales0 * self.log_scales.exp(),
        )

    def weight(self) -> Tensor:
        alpha, beta, scales = self.statistics()
        Wt = scales.unsqueeze(1) * (alpha * self.g + beta)
        if self.layer.incoherence:
            return incoherence_unprocess(Wt, self.layer.seed_out, self.layer.seed_in)
        return Wt

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @torch.no_grad()
    def write_back(self) -> TrellisLinear:
        """Store the tuned statistics in the quantised layer (its packed bits are untouched) and return it."""
        alpha, beta, scales = (t.detach() for t in self.statistics())
        layer = self.layer
        if self.log_alpha.requires_grad:  # only what was tuned: a round trip through fp32 would perturb α, β
            layer.code_params["alpha"], layer.code_params["beta"] = float(alpha), float(beta)
            layer.code_floats.copy_(torch.tensor([float(alpha), float(beta)], dtype=torch.float64))
        if self.log_scales.requires_grad:
            layer.scales.copy_(scales.to(layer.scales.dtype))
        return layer


def _batches(calibration) -> list[dict[str, Tensor]]:
    """Normalise calibration data to a list of ``{"input_ids", "attention_mask"}`` dicts."""
    if isinstance(calibration, Tensor):
        calibration = [calibration]
    if isinstance(calibration, Mapping):
        calibration = [calibration]
    if not isinstance(calibration, Iterable):
        raise TypeError("calibration must be a tensor of token ids, a batch dict, or an iterable of them")
    out = []
    for item in calibration:
        if isinstance(item, Tensor):
            ids = item if item.dim() == 2 else item.unsqueeze(0)
            out.append({"input_ids": ids.long(), "attention_mask": torch.ones_like(ids, dtype=torch.long)})
        elif isinstance(item, Mapping) and "input_ids" in item:
            ids = torch.as_tensor(item["input_ids"])
            ids = ids if ids.dim() == 2 else ids.unsqueeze(0)
            mask = torch.as_tensor(item.get("attention_mask", torch.ones_like(ids))).reshape(ids.shape)
            out.append({"input_ids": ids.long(), "attention_mask": mask.long()})
        else:
            raise TypeError(
                f"calibration items must be token-id tensors or dicts with input_ids, got {type(item)}"
            )
    if not out:
        raise ValueError("calibration data is empty")
    return out


def _log_probs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).logits.float().log_softmax(-1)


def distill_affine(
    student: nn.Module,
    teacher: nn.Module,
    calibration,
    *,
    tune: Sequence[str] = ("affine", "scales"),
    steps: int = 50,
    lr: float = 1e-2,
) -> list[float]:
    """Tune the quantised layers' ``α, β`` (Proteus) and/or ``σ`` of ``student`` towards ``teacher``.

    Args:
        student: a model whose ``nn.Linear`` layers were replaced by :class:`TrellisLinear` (modified in place).
        teacher: the full-precision model (only run forward, under ``no_grad``).
        calibration: token ids ``[b, T]``, a batch dict (``input_ids``, optional ``attention_mask``) or an
            iterable of either: the few calibration sequences.
        tune: ``"affine"`` and/or ``"scales"`` (see the module docstring). Layers whose code has no affine
            (QTIP codes, RTN) tune their scales only.
        steps: full passes over the calibration batches (one Adam step each pass).
        lr: Adam learning rate (relative: ``α`` and ``σ`` are optimised as log-ratios to their start values,
            ``β`` in units of the generator's standard deviation).

    Returns:
        The calibration KL (nats per attended position) before the first step and after each step.
    """
    tune_set = set(tune)
    if not tune_set or not tune_set <= set(_TUNABLE):
        raise ValueError(f"tune must be a non-empty subset of {_TUNABLE}, got {tuple(tune)}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    layers = [(n, m) for n, m in student.named_modules() if isinstance(m, TrellisLinear)]
    if not layers:
        raise ValueError("student has no TrellisLinear layers: quantise it first (quantize_model)")
    if tune_set == {"affine"} and not any(m.code == "proteus" for _, m in layers):
        raise ValueError("tune=('affine',) needs Proteus layers; the QTIP codes and RTN have no affine")
    batches = _batches(calibration)
    device = layers[0][1].packed.device
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    teacher.eval()
    with torch.no_grad():
        targets = [_log_probs(teacher, b) for b in batches]
    was_training = student.training
    frozen = [p for p in student.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    stand_ins = {name: _DenseStandIn(layer, tune_set).to(device) for name, layer in layers}
    for name, stand in stand_ins.items():
        _set_module(student, name, stand)
    tuned = [p for stand in stand_ins.values() for p in stand.parameters() if p.requires_grad]
    opt = torch.optim.Adam(tuned, lr=lr)
    student.eval()

    def calibration_kl() -> Tensor:
        total, count = 0.0, 0
        for batch, target in zip(batches, targets, strict=True):
            logp = _log_probs(student, batch)
            per_position = (target.exp() * (target - logp)).sum(-1)
            mask = batch["attention_mask"].to(per_position.dtype)
            total = total + (per_position * mask).sum()
            count += int(mask.sum())
        return total / max(count, 1)

    history: list[float] = []
    try:
        for step in range(steps + 1):
            loss = calibration_kl()
            history.append(float(loss.detach()))
            if not math.isfinite(history[-1]):
                raise FloatingPointError(f"distillation KL is not finite at step {step}")
            if step == steps or not tuned:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        # Always put the (possibly partly tuned) quantised layers back: never leave stand-ins in the model.
        for name, stand in stand_ins.items():
            _set_module(student, name, stand.write_back())
        for p in frozen:
            p.requires_grad_(True)
        student.train(was_training)
    return history
