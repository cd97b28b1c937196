r"""Gradient signal-to-noise ratio (GSNR) of parameters over a window of optimisation steps.

For a parameter element :math:`\theta_j` and the minibatch gradients :math:`g_{1,j}, \dots, g_{S,j}` of
:math:`S` = ``window`` consecutive optimiser steps,

.. math::
    \mathrm{GSNR}_j = \frac{\bar g_j^{\,2}}{s_j^2}, \qquad
    \bar g_j = \frac1S \sum_{s=1}^S g_{s,j}, \qquad
    s_j^2 = \frac{1}{S-1} \sum_{s=1}^S (g_{s,j} - \bar g_j)^2

(the unbiased sample variance, so ``window >= 2``). Following Liu et al. (2020) a high GSNR means the
minibatches agree on the direction of the update. The parameters move during the window, so this is the GSNR
of the gradients actually applied, not of a frozen point; keep the window short relative to the learning-rate
scale.

:func:`gradient_snr` computes it from stacked gradients; :class:`GradientSNRMonitor` computes the same thing
online (Welford's running mean and sum of squared deviations, fp64) and logs per-parameter and overall means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

__all__ = ["GradientSNRMonitor", "gradient_snr", "mean_finite"]


def gradient_snr(grads: Tensor) -> Tensor:
    r"""Element-wise GSNR :math:`\bar g^2 / s^2` (fp64) of ``grads [S, ...]``, the gradients of ``S >= 2``
    steps.

    :math:`s^2` is the unbiased variance over the first dimension. Elements whose variance is 0 give ``inf``
    (constant non-zero gradient) or ``nan`` (always zero): both are left as they are; :func:`mean_finite`
    averages over the rest.
    """
    if grads.ndim < 1 or grads.shape[0] < 2:
        raise ValueError(f"need gradients of at least 2 steps along dim 0, got shape {tuple(grads.shape)}")
    g = grads.double()
    return g.mean(0).square() / g.var(0, correction=1)


def mean_finite(values: Tensor) -> float:
    """Mean of the finite entries of ``values`` (NaN if none)."""
    finite = values[torch.isfinite(values)]
    return float(finite.mean()) if finite.numel() else float("nan")


class _Welford:
    """Running count, mean and sum of squared deviations of one tensor's values, element-wise, in fp64."""

    def __init__(self, mean: Tensor, m2: Tensor) -> None:
        self.mean, self.m2 = mean, m2

    @classmethod
    def zeros_like(cls, like: Tensor) -> _Welford:
        return cls(torch.zeros_like(like, dtype=torch.float64), torch.zeros_like(like, dtype=torch.float64))

    def add(self, value: Tensor, count: int) -> None:
        """Add the ``count``-th sample (1-based)."""
        if self.mean.device != value.device:  # a state loaded from a checkpoint joins its gradient's device
            self.mean, self.m2 = self.mean.to(value.device), self.m2.to(value.device)
        value = value.double()
        delta = value - self.mean
        self.mean += delta / count
        self.m2 += delta * (value - self.mean)

    def gsnr(self, count: int) -> Tensor:
        return self.mean.square() / (self.m2 / (count - 1))


class GradientSNRMonitor(Callback):
    r"""Log the mean GSNR (module docstring) of chosen parameters every ``window`` optimiser steps.

    In ``on_before_optimizer_step`` each chosen parameter's gradient is added to a running element-wise mean
    and sum of squared deviations (fp64, on the parameter's device). After ``window`` steps the callback logs,
    via ``pl_module.log`` (``on_step``), ``{log_prefix}/{parameter name}``: the mean GSNR over the parameter's
    elements, and ``{log_prefix}/mean``: the mean over all chosen elements pooled; then it starts a new
    window. Elements whose gradient variance is 0 (GSNR infinite or undefined, e.g. embedding rows no batch
    touched) are left out of the means. The latest values are in :attr:`last`; :attr:`history` holds
    ``(global_step, values)`` per window end (Lightning increments ``global_step`` after the step: windows end
    at ``window - 1``, ``2 window - 1``, …).

    When in the step: Lightning calls ``on_before_optimizer_step`` after the backward pass(es) of the step
    (with gradient accumulation: on the accumulated gradient, one sample per optimiser step), after AMP's
    unscaling (the gradient is the true one, not ``loss_scale ×`` it) and **before gradient clipping**: the
    GSNR is that of the raw gradients, which clipping only rescales per step. Every call of the hook is one
    sample (under manual optimisation: every ``optimizer.step()``). A parameter whose ``.grad`` is ``None`` at
    a step (not in the graph) counts as a zero gradient.

    DDP: gradients are already all-reduced when the hook runs, so the samples are the *global-batch*
    gradients, identical on every rank (the logged values are too: no sync needed). Sharded strategies (FSDP,
    DeepSpeed ZeRO ≥ 2) hold only a shard of each gradient per rank and are not supported.

    The running state (step count in the window, means, squared deviations) is in :meth:`state_dict`, so a run
    resumed from a checkpoint continues the window exactly.

    Args:
        parameters: Substrings of parameter names (``pl_module.named_parameters()``): a trainable parameter is
            chosen if its name contains any. ``None``: every trainable parameter.
        window: Steps per estimate, ``>= 2``.
        log_prefix: Prefix of the logged keys.
    """

    def __init__(
        self, parameters: Sequence[str] | None = None, window: int = 16, log_prefix: str = "gsnr"
    ) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2 (the variance needs two samples), got {window}")
        if parameters is not None and (isinstance(parameters, str) or not parameters):
            raise ValueError("parameters must be a non-empty list of name substrings, or None")
        self.parameters = None if parameters is None else list(parameters)
        self.window = window
        self.log_prefix = log_prefix
        self.count = 0  # steps added to the current window
        self._stats: dict[str, _Welford] = {}
        self.last: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []

    def chosen_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters of ``module`` this callback follows, by name."""
        chosen = {
            name: p
            for name, p in module.named_parameters()
            if p.requires_grad and (self.parameters is None or any(s in name for s in self.parameters))
        }
        if not chosen:
            raise ValueError(f"no trainable parameter of {type(module).__name__} matches {self.parameters}")
        return chosen

    def add_step(self, module: nn.Module) -> dict[str, float] | None:
        """Add the current gradients of ``module`` as one step; at a window end return the means and reset."""
        params = self.chosen_parameters(module)
        if self._stats and set(self._stats) != set(params):
            raise RuntimeError(
                f"the chosen parameters changed within a window: {sorted(self._stats)} vs {sorted(params)}"
            )
        self.count += 1
        for name, p in params.items():
            stats = self._stats.get(name)
            if stats is None:
                stats = self._stats[name] = _Welford.zeros_like(p.detach())
            grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
            stats.add(grad, self.count)
        if self.count < self.window:
            return None
        result, total, finite = {}, 0.0, 0
        for name, stats in self._stats.items():
            value = stats.gsnr(self.count)
            keep = torch.isfinite(value)
            part, n = float(value[keep].sum()), int(keep.sum())
            result[name] = part / n if n else float("nan")
            total, finite = total + part, finite + n
        result["mean"] = total / finite if finite else float("nan")
        self.count, self._stats = 0, {}
        return result

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        result = self.add_step(pl_module)
        if result is None:
            return
        self.last = result
        self.history.append((trainer.global_step, result))
        for name, value in result.items():
            pl_module.log(f"{self.log_prefix}/{name}", value, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean": {n: s.mean.cpu().clone() for n, s in self._stats.items()},
            "m2": {n: s.m2.cpu().clone() for n, s in self._stats.items()},
            "last": dict(self.last),
            "history": list(self.history),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Loaded on the CPU; each state moves to its parameter's device with the first gradient added to it.
        self.count = int(state_dict["count"])
        self._stats = {
            n: _Welford(state_dict["mean"][n].double().clone(), state_dict["m2"][n].double().clone())
            for n in state_dict["mean"]
        }
        self.last = dict(state_dict.get("last", {}))
        self.history = list(state_dict.get("history", []))
