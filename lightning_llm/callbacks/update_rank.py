"""How high-rank the accumulated weight update is: ``stable_rank(W_t − W_0)`` per adapted layer.

Plain LoRA's update ``s B A`` has rank at most ``r``; ScaLoRA and merge-and-restart accumulate many rank-``r``
increments into the base weight, so their ``W_t − W_0`` can exceed ``r``. This callback measures that for any
model: LoRA layers (the effective weight ``W_0 + s B A``) or, for full fine-tuning, plain linear layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.lora import (
    DEFAULT_TARGET_MODULES,
    iter_effective_weights,
    module_matches,
    stable_rank,
)

__all__ = ["UpdateRankMonitor"]


def _tracked_weights(module: nn.Module, targets: Sequence[str]) -> dict[str, Tensor]:
    """Current effective weights (fp32, detached) of the LoRA layers, or else of linear layers in ``targets``."""
    lora = dict(iter_effective_weights(module))
    if lora:
        return lora
    return {
        n: m.weight.detach().float()
        for n, m in module.named_modules()
        if isinstance(m, nn.Linear) and module_matches(n, targets)
    }


class _UpdateRankTracker:
    """Snapshot of the weights at the start of training and the stable rank of the change since then."""

    def __init__(self, targets: Sequence[str]) -> None:
        self.targets = tuple(targets)
        self.initial: dict[str, Tensor] = {}

    def snapshot_if_empty(self, module: nn.Module) -> None:
        if not self.initial:
            # On the CPU: one fp32 copy of every tracked weight is the price of measuring the update.
            self.initial = {n: w.cpu().clone() for n, w in _tracked_weights(module, self.targets).items()}
            if not self.initial:
                raise ValueError(f"no LoRA layers and no linear layers matching {self.targets} to track")

    def stable_ranks(self, module: nn.Module) -> dict[str, float]:
        current = _tracked_weights(module, self.targets)
        return {n: stable_rank(current[n].cpu() - w0) for n, w0 in self.initial.items() if n in current}

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = dict(state.get("initial", {}))


def log_stable_ranks(pl_module: L.LightningModule, prefix: str, ranks: dict[str, float]) -> None:
    """Log the mean stable rank and one value per layer (``<prefix>/stable_rank/<layer path>``)."""
    if not ranks:
        return
    pl_module.log(f"{prefix}/stable_rank_mean", sum(ranks.values()) / len(ranks), on_step=True)
    for name, value in ranks.items():
        pl_module.log(f"{prefix}/stable_rank/{name}", value, on_step=True)


class UpdateRankMonitor(Callback):
    """Log ``stable_rank(W_t − W_0)`` per layer every ``every`` optimizer steps (and keep a history).

    Args:
        every: measure every this many optimizer steps (an SVD per layer; cheap for small models only).
        targets: linear layers to track when the model has no LoRA layers (full fine-tuning).

    Attributes:
        history: ``[(step, {layer: stable_rank})]``, handy for plots.
    """

    def __init__(self, every: int = 10, targets: Sequence[str] = DEFAULT_TARGET_MODULES) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every
        self._tracker = _UpdateRankTracker(targets)
        self.history: list[tuple[int, dict[str, float]]] = []
        self._last = 0

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tracker.snapshot_if_empty(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps (also under manual optimisation with several per batch).
        step = trainer.global_step
        if step // self.every > self._last // self.every:
            ranks = self._tracker.stable_ranks(pl_module)
            self.history.append((step, ranks))
            log_stable_ranks(pl_module, "UpdateRank", ranks)
            self._last = step

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self._tracker.state_dict(), "history": self.history, "last": self._last}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._tracker.load_state_dict(state_dict)
        self.history = list(state_dict.get("history", []))
        self._last = state_dict.get("last", 0)
