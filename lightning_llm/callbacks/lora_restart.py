r"""Merge-and-restart LoRA (ReLoRA-style; Lialin et al., 2023): the baseline ScaLoRA claims to beat.

Every ``interval`` optimizer steps each adapter is merged into its frozen weight,
:math:`W_0 \leftarrow W_0 + s B A`, re-initialised (``A`` Kaiming-uniform, ``B = 0``) and its optimizer state
is dropped, so the next ``interval`` steps learn a fresh rank-``r`` increment and the accumulated update can
reach rank ``r × restarts``. Compared with ReLoRA this keeps the learning-rate schedule as it is (no jagged
re-warm-up) and resets the moments fully instead of pruning 99% of them; both are simplifications.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_llm.lora import LoRALinear, lora_layers

__all__ = ["LoRARestart", "restart_lora_layer"]


@torch.no_grad()
def restart_lora_layer(layer: LoRALinear, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Merge ``s B A`` into the base weight, re-initialise the factors and forget their optimizer state."""
    layer.base_layer.weight.add_(layer.delta_weight())
    layer.base_modified.fill_(True)
    layer.reset_lora_parameters()
    if optimizer is not None:
        for param in (layer.lora_A.weight, layer.lora_B.weight):
            optimizer.state.pop(param, None)


class LoRARestart(Callback):
    """Merge every adapter into its base weight and restart it every ``interval`` optimizer steps.

    Runs right *after* the optimizer step (a ``register_step_post_hook`` on each optimizer, so it counts
    steps the same way under automatic and manual optimisation).

    Args:
        interval: optimizer steps between restarts.
    """

    def __init__(self, interval: int = 100) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self.optimizer_steps = 0
        self.restarts = 0
        self._handles: list[RemovableHandle] = []

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers = lora_layers(pl_module)
        if not layers:
            raise ValueError(
                "LoRARestart needs a model with LoRA layers: pass lora=LoRAConfig(...) to the module"
            )

        def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            self.optimizer_steps += 1
            if self.optimizer_steps % self.interval == 0:
                for layer in lora_layers(pl_module).values():
                    restart_lora_layer(layer, optimizer)
                self.restarts += 1

        self._handles = [opt.register_step_post_hook(after_step) for opt in trainer.optimizers]

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps, "restarts": self.restarts}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer_steps = state_dict["optimizer_steps"]
        self.restarts = state_dict["restarts"]
