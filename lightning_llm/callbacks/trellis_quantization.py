"""Lightning callback: trellis-quantise a trained model's linear layers at the end of ``fit`` (Proteus / QTIP)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llm.callbacks.calibration import calibration_batches, check_calibration
from lightning_llm.lm import check_export, mark_export
from lightning_llm.quantization import TrellisLinear, quantize_model, save_quantized

__all__ = ["TrellisQuantization"]

_FAST_DEV_RUN_L = 8  # state bits under fast_dev_run (256 states: seconds for the tiny model, not minutes)


class TrellisQuantization(Callback):
    """Replace every ``nn.Linear`` of ``pl_module.model`` (except ``skip``) by a :class:`TrellisLinear`.

    At the end of ``fit`` (when ``at_fit_end``; :meth:`quantize` does it on demand for any model) the callback
    runs :func:`~lightning_llm.quantization.quantize_model` with its settings, then, if ``save_dir`` is set,
    writes the quantised model with :func:`~lightning_llm.quantization.save_quantized` (and the module's
    ``tokenizer``, if any, with ``save_pretrained``) on global rank zero; reload with
    :func:`~lightning_llm.quantization.load_quantized`. Do not also pass ``save_dir`` to ``CausalLMModule``:
    its ``save_pretrained`` output of a quantised model is not loadable by ``load_backbone``. Quantisation is
    deterministic (seeded Hadamards, Viterbi), so under DDP every rank quantises its replica to the same bits
    without communication (the optional distillation uses each rank's own first train batches, so under DDP
    the tuned statistics are then broadcast from rank zero).

    With ``calibration`` (a number of train batches, or a list of strings tokenized by the module's
    ``tokenizer``), the quantised model's affine statistics are then distilled towards the full-precision one
    (:func:`~lightning_llm.quantization.distill_affine`; ``distill_tune`` / ``distill_steps`` / ``distill_lr``).

    Under ``fast_dev_run`` the trellis is encoded at ``min(L, 8)`` state bits (and at most 2 distillation
    steps): the code path runs end to end in seconds instead of minutes; the quality is not meaningful then, and
    nothing is written to ``save_dir`` (the model a real run saved there stays).

    Args:
        method: ``"proteus"``, ``"qtip-1mad"``, ``"qtip-3inst"`` or ``"rtn"``.
        bits, L, V: trellis parameters (bits per weight, state bits, weights per step).
        skip: module names (or dotted name components) left in full precision.
        save_dir: optional directory for :func:`save_quantized`. It gets an export marker with the run id (the
            module's ``run_id`` when it has one); a ``save_dir`` holding files another run wrote (or files with
            no marker) stops the fit at its start unless ``overwrite``.
        overwrite: let the export replace such a ``save_dir``.
        at_fit_end: quantise in ``on_fit_end``; False leaves it to :meth:`quantize`.
        seed: base Hadamard seed (layer ``i`` uses ``seed + i``).
        calibration: None (data-free), a number of train batches, or a list of strings: few-shot
            distillation data.
        distill_tune, distill_steps, distill_lr: see :func:`~lightning_llm.quantization.distill_affine`.
        **quantize_kwargs: passed to :func:`~lightning_llm.quantization.quantize_matrix` (e.g. ``chunk_tiles``,
            ``proxy_tiles``).
    """

    def __init__(
        self,
        method: str = "proteus",
        bits: int = 2,
        L: int = 16,
        V: int = 1,
        *,
        skip: tuple[str, ...] = ("lm_head",),
        save_dir: str | Path | None = None,
        overwrite: bool = False,
        at_fit_end: bool = True,
        seed: int = 0,
        calibration: int | Sequence[str] | None = None,
        distill_tune: tuple[str, ...] = ("affine", "scales"),
        distill_steps: int = 50,
        distill_lr: float = 1e-2,
        **quantize_kwargs: Any,
    ) -> None:
        if method not in ("proteus", "qtip-1mad", "qtip-3inst", "rtn"):
            raise ValueError(f"unknown method {method!r}")
        check_calibration(calibration, allow_none=True)
        self.calibration = (
            calibration if calibration is None or isinstance(calibration, int) else list(calibration)
        )
        self.distill = {
            "distill_tune": tuple(distill_tune),
            "distill_steps": distill_steps,
            "distill_lr": distill_lr,
        }
        self.method, self.bits, self.L, self.V = method, bits, L, V
        self.skip, self.save_dir, self.at_fit_end, self.seed = tuple(skip), save_dir, at_fit_end, seed
        self.overwrite = overwrite
        self.run_id = uuid.uuid4().hex  # used when the module has no run_id of its own
        self.quantize_kwargs = dict(quantize_kwargs)
        self.quantized_layers: list[str] = []
        self.distillation: dict[str, Any] = {}

    def quantize(
        self,
        model: torch.nn.Module,
        calibration=None,
        *,
        L: int | None = None,
        distill_steps: int | None = None,
    ) -> torch.nn.Module:
        """Quantise ``model`` in place (see the class docstring) and return it.

        ``calibration``: batches for the distillation (None: data-free); ``L`` / ``distill_steps`` override the
        callback's settings (used under ``fast_dev_run``).
        """
        distill = dict(self.distill)
        if distill_steps is not None:
            distill["distill_steps"] = distill_steps
        quantize_model(
            model,
            method=self.method,
            bits=self.bits,
            L=self.L if L is None else L,
            V=self.V,
            skip=self.skip,
            seed=self.seed,
            calibration=calibration,
            **distill,
            **self.quantize_kwargs,
        )
        self.quantized_layers = [n for n, m in model.named_modules() if isinstance(m, TrellisLinear)]
        self.distillation = dict(getattr(model, "trellis_quantization", {}).get("distillation", {}))
        return model

    def _run_id(self, pl_module: L.LightningModule) -> str:
        return str(getattr(pl_module, "run_id", None) or self.run_id)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.save_dir is not None and self.at_fit_end and not trainer.fast_dev_run:
            check_export(
                self.save_dir, self._run_id(pl_module), overwrite=self.overwrite, writer="TrellisQuantization"
            )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_fit_end:
            return
        model = getattr(pl_module, "model", pl_module)
        calibration = None
        if self.calibration is not None:
            calibration = [
                {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                for batch in calibration_batches(trainer, pl_module, self.calibration)
            ]
        quick = bool(trainer.fast_dev_run)
        self.quantize(
            model,
            calibration,
            L=min(self.L, _FAST_DEV_RUN_L) if quick else None,
            distill_steps=min(self.distill["distill_steps"], 2) if quick else None,
        )
        if calibration is not None and trainer.world_size > 1:
            # Ranks distilled on different shards: every rank takes rank zero's statistics (same bits).
            stats = {
                n: (m.scales, m.code_floats, dict(m.code_params))
                for n, m in model.named_modules()
                if isinstance(m, TrellisLinear)
            }
            stats = trainer.strategy.broadcast(stats, src=0)
            for name, (scales, floats, params) in stats.items():
                layer = model.get_submodule(name)
                layer.scales.copy_(scales.to(layer.scales.device))
                layer.code_floats.copy_(floats.to(layer.code_floats.device))
                layer.code_params = params
        rank_zero_info(
            f"TrellisQuantization({self.method}): {len(self.quantized_layers)} layers quantised"
            + (
                f", distillation KL {self.distillation['kl_before']:.4g} -> {self.distillation['kl_after']:.4g}"
                if self.distillation
                else ""
            )
        )
        if self.save_dir is not None and quick:
            rank_zero_info(
                f"TrellisQuantization: fast_dev_run writes no export; save_dir={self.save_dir} is left as it is"
            )
        elif self.save_dir is not None and trainer.is_global_zero:
            save_quantized(model, self.save_dir)
            tokenizer = getattr(pl_module, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(self.save_dir)
            mark_export(self.save_dir, self._run_id(pl_module), "TrellisQuantization")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "bits": self.bits,
            "L": self.L,
            "V": self.V,
            "layers": self.quantized_layers,
            "distillation": dict(self.distillation),
            "run_id": self.run_id,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantized_layers = list(state_dict.get("layers", []))
        self.distillation = dict(state_dict.get("distillation", {}))
        self.run_id = str(state_dict.get("run_id") or self.run_id)
