"""2-bit quantisers compared on a trained tiny model (tutorial 19, ``tests/behaviour/test_proteus.py``,
``benchmarks/quant.py``).

:func:`train_arithmetic_model` trains the embedded ``"tiny"`` backbone on two-digit arithmetic with ``+ - *``
(exact arithmetic is sensitive to weight error; a model trained on PCFG sentences was not: RTN-2 left its
perplexity unchanged). :func:`compare_quantizers` quantises copies of a model with each method and scores
held-out perplexity of the response tokens, with the encoding time.

Methods (keys of :data:`METHODS`): ``"fp32"`` (unquantised), ``"nf4"`` (bitsandbytes NF4, 4 bits + an fp32
absmax per 64), ``"rtn"`` (round-to-nearest 2-bit, per-row MSE-best step, no rotation: the plain RTN-2
baseline), ``"rtn+hadamard"`` (the same grid after the random Hadamard incoherence), ``"qtip-1mad"``,
``"qtip-3inst"``, ``"proteus"`` (2-bit trellis codes after incoherence, channel compensation) and
``"proteus+distill"`` (Proteus, then few-shot distillation of the affine statistics on ``calibration``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning import seed_everything
from torch import Tensor, nn

from lightning_llm.datamodules import ChatSFTDataModule
from lightning_llm.metrics import perplexity
from lightning_llm.modules import CausalLMModule
from lightning_llm.quantization import distill_quantized, quantize_model, quantize_model_nf4
from lightning_llm.trainer import quiet_trainer
from lightning_llm.types import IGNORE_INDEX

__all__ = ["METHODS", "compare_quantizers", "train_arithmetic_model"]

METHODS = ("fp32", "nf4", "rtn", "rtn+hadamard", "qtip-1mad", "qtip-3inst", "proteus", "proteus+distill")


def train_arithmetic_model(
    steps: int = 800,
    *,
    seed: int = 0,
    batch_size: int = 64,
    lr: float = 5e-3,
    num_val: int = 200,
    trainer_kwargs: Mapping[str, Any] | None = None,
):
    """Train ``"tiny"`` with ``CausalLMModule`` on ``arithmetic`` (2 digits, ``+-*``); returns ``(model, data)``.

    ``data`` is the fitted ``ChatSFTDataModule`` (its ``val_dataloader`` holds the ``num_val`` held-out
    conversations). The Trainer is a quiet single-process CPU one unless ``trainer_kwargs`` say otherwise.
    """
    seed_everything(seed, verbose=False)
    data = ChatSFTDataModule(
        task="arithmetic",
        task_kwargs={"digits": 2, "ops": "+-*"},
        num_train=steps * batch_size,
        num_val=num_val,
        batch_size=batch_size,
        max_length=64,
        seed=seed,
    )
    lm = CausalLMModule("tiny", lr=lr)
    quiet_trainer(steps, **(trainer_kwargs or {})).fit(lm, data)
    return lm.model.eval(), data


def _quantizer(method: str, L: int, calibration, distill_steps: int) -> Callable[[nn.Module], nn.Module]:
    if method == "fp32":
        return lambda m: m
    if method == "nf4":
        return quantize_model_nf4
    if method == "rtn":
        return lambda m: quantize_model(m, "rtn", incoherence=False)
    if method == "rtn+hadamard":
        return lambda m: quantize_model(m, "rtn")
    if method == "proteus+distill":
        return lambda m: quantize_model(
            m, "proteus", L=L, calibration=calibration, distill_steps=distill_steps
        )
    return lambda m: quantize_model(m, method, L=L)


def _response_log_probs(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Next-token log-probabilities ``[n, vocab]`` at the scored positions (``labels[t + 1] != IGNORE_INDEX``)."""
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    scored = batch["labels"][:, 1:] != IGNORE_INDEX
    return logits[scored].float().log_softmax(-1)


def _mean_kl(reference: Sequence[Tensor], other: Sequence[Tensor]) -> float:
    """Mean over scored tokens of ``KL(reference ‖ other)``."""
    total = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other, strict=True))
    return total / max(sum(r.shape[0] for r in reference), 1)


def compare_quantizers(
    model: nn.Module,
    held_out: Sequence[Mapping[str, Tensor]],
    *,
    methods: Sequence[str] = METHODS,
    L: int = 16,
    calibration: Mapping[str, Tensor] | None = None,
    distill_steps: int = 50,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """``{method: {"perplexity", "kl_to_fp32", "seconds", "model"}}``: each method on a fresh copy of ``model``.

    ``kl_to_fp32``: mean ``KL(p_model ‖ p_quantised)`` of the next-token distributions at the scored held-out
    positions (what the distillation minimises on its calibration data).

    ``seconds`` is the wall time of quantising (and distilling); ``model`` the quantised copy. ``L`` applies
    to the trellis methods. ``calibration``: a batch (``input_ids``, ``attention_mask``) for
    ``"proteus+distill"``, distilled for ``distill_steps`` Adam steps.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {METHODS}")
    if "proteus+distill" in methods and calibration is None:
        raise ValueError("'proteus+distill' needs calibration batches")
    with torch.no_grad():
        reference = [_response_log_probs(model, batch) for batch in held_out]
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        start = time.perf_counter()
        if method == "proteus+distill" and "proteus" in out:
            # The same bits as "proteus" (the encoding is deterministic): distil a copy instead of re-encoding.
            quantized = copy.deepcopy(out["proteus"]["model"])
            distill_quantized(quantized, model, calibration, steps=distill_steps)
            seconds = out["proteus"]["seconds"] + time.perf_counter() - start
        else:
            quantized = _quantizer(method, L, calibration, distill_steps)(copy.deepcopy(model))
            seconds = time.perf_counter() - start
        with torch.no_grad():
            ppl = perplexity(quantized, held_out)
            kl = _mean_kl(reference, [_response_log_probs(quantized, batch) for batch in held_out])
        out[method] = {"perplexity": ppl, "kl_to_fp32": kl, "seconds": seconds, "model": quantized}
        if log is not None:
            log(f"{method:>16}: perplexity {ppl:.4f}, KL to fp32 {kl:.4f} nats/token ({seconds:.1f} s)")
    return out
