"""Lightning callback: trellis-quantise a trained model's linear layers at the end of ``fit`` (Proteus / QTIP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llm.quantization.linear import TrellisLinear, quantize_model, save_quantized

__all__ = ["TrellisQuantization"]


class TrellisQuantization(Callback):
    """Replace every ``nn.Linear`` of ``pl_module.model`` (except ``skip``) by a :class:`TrellisLinear`.

    At the end of ``fit`` (when ``at_fit_end``; :meth:`quantize` does it on demand for any model) the callback
    runs :func:`~lightning_llm.quantization.quantize_model` with its settings, then, if ``save_dir`` is set,
    writes the quantised model with :func:`~lightning_llm.quantization.save_quantized` (and the module's
    ``tokenizer``, if any, with ``save_pretrained``) on global rank zero; reload with
    :func:`~lightning_llm.quantization.load_quantized`. Do not also pass ``save_dir`` to ``CausalLMModule``:
    its ``save_pretrained`` output of a quantised model is not loadable by ``load_backbone``. Quantisation is
    deterministic (seeded Hadamards, Viterbi), so under DDP every rank quantises its replica to the same bits
    without communication.

    Args:
        method: ``"proteus"``, ``"qtip-1mad"``, ``"qtip-3inst"`` or ``"rtn"``.
        bits, L, V: trellis parameters (bits per weight, state bits, weights per step).
        skip: module names (or dotted name components) left in full precision.
        save_dir: optional directory for :func:`save_quantized`.
        at_fit_end: quantise in ``on_fit_end``; False leaves it to :meth:`quantize`.
        seed: base Hadamard seed (layer ``i`` uses ``seed + i``).
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
        at_fit_end: bool = True,
        seed: int = 0,
        **quantize_kwargs: Any,
    ) -> None:
        if method not in ("proteus", "qtip-1mad", "qtip-3inst", "rtn"):
            raise ValueError(f"unknown method {method!r}")
        self.method, self.bits, self.L, self.V = method, bits, L, V
        self.skip, self.save_dir, self.at_fit_end, self.seed = tuple(skip), save_dir, at_fit_end, seed
        self.quantize_kwargs = dict(quantize_kwargs)
        self.quantized_layers: list[str] = []

    def quantize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantise ``model`` in place (see the class docstring) and return it."""
        quantize_model(
            model,
            method=self.method,
            bits=self.bits,
            L=self.L,
            V=self.V,
            skip=self.skip,
            seed=self.seed,
            **self.quantize_kwargs,
        )
        self.quantized_layers = [n for n, m in model.named_modules() if isinstance(m, TrellisLinear)]
        return model

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.at_fit_end:
            return
        model = getattr(pl_module, "model", pl_module)
        self.quantize(model)
        rank_zero_info(f"TrellisQuantization({self.method}): {len(self.quantized_layers)} layers quantised")
        if self.save_dir is not None and trainer.is_global_zero:
            save_quantized(model, self.save_dir)
            tokenizer = getattr(pl_module, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(self.save_dir)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "bits": self.bits,
            "L": self.L,
            "V": self.V,
            "layers": self.quantized_layers,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quantized_layers = list(state_dict.get("layers", []))
