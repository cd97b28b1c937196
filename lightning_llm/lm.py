"""Helpers every module shares to get per-token log-probs from a Hugging Face causal LM without logits.

The fused kernel needs the last hidden states and the LM-head weight separately, so the ``[tokens × vocab]``
logits tensor is never built. That is only exact for heads that are a plain bias-free linear map; models that
post-process logits (soft-capping, a logit scale) are refused at construction with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_llm.kernels import fused_linear_logprobs
from lightning_llm.lora import LoRAConfig, apply_lora, lora_layers, merge_lora, save_adapter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100


def check_fused_compatible(model: PreTrainedModel) -> None:
    """Raise if the model's logits are not ``hidden @ lm_head.weight.T`` (the fused path would be wrong)."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        raise ValueError(f"{type(model).__name__} has no linear output embedding; fused log-probs need one")
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{type(model).__name__}'s LM head has a bias, which the fused log-prob path ignores"
        )
    config = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value not in (None, 1.0, 0.0):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits ({attr}={value}); the fused log-prob "
                "path computes hidden @ W.T only and would give wrong log-probs"
            )


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as ``generate`` does: left padding does not shift the prompt."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def last_hidden_states(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Final hidden states ``[B, T, H]`` (after the final norm) without computing logits.

    With an attention mask, position ids are derived from it, so a left-padded sequence is scored with the
    same positions it was generated with.
    """
    position_ids = None if attention_mask is None else position_ids_from_mask(attention_mask)
    out = decoder_outputs(
        model, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state


def decoder_outputs(model: PreTrainedModel, **kwargs: Any) -> Any:
    """The decoder's own output (``last_hidden_state`` after the final norm, ``past_key_values``) for ``kwargs``.

    Runs the decoder (``model.get_decoder()``) directly, so no logits are computed. Under FSDP2 the embeddings
    and the head belong to the root unit, gathered only inside the root's forward: then it goes through the root
    (logits of one position only) and takes the decoder's output from a hook.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    if not is_fsdp(model):
        return _as_decoder_output(decoder(**kwargs))
    captured: list[Any] = []

    def capture(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output)

    handle = decoder.register_forward_hook(capture)
    try:
        model(**kwargs, logits_to_keep=1)
    finally:
        handle.remove()
    return _as_decoder_output(captured[0])


def _as_decoder_output(output: Any) -> Any:
    if hasattr(output, "last_hidden_state"):
        return output
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return BaseModelOutputWithPast(last_hidden_state=output[0])


def is_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FSDPModule)


def shard_fsdp2(model: torch.nn.Module, mesh: Any) -> None:
    """FSDP2 (``fully_shard``) over ``mesh``: every decoder layer its own unit, the rest (embeddings, final norm,
    head) the root unit. What ``configure_model`` does under Lightning's ``ModelParallelStrategy``."""
    from torch.distributed.fsdp import fully_shard

    from lightning_llm.backbones.inspect import decoder_layers

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def target_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    target_mask: Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_dynamics: bool = False,
) -> tuple[Tensor, ...]:
    """Log-prob and entropy (with ``with_dynamics`` also S_k and N) of each next token in ``target_mask``.

    ``target_mask[b, t]`` says whether token ``t`` of row ``b`` is predicted (from position ``t − 1``); the
    first column is ignored. Returns flat fp32 vectors in row-major order of the selected tokens: only those
    tokens go through the LM head, so masked prompt tokens cost no vocabulary work.
    """
    hidden = last_hidden_states(model, input_ids, attention_mask)
    select = target_mask[:, 1:].bool()
    weight = model.get_output_embeddings().weight
    return fused_linear_logprobs(
        hidden[:, :-1][select],
        weight,
        input_ids[:, 1:][select],
        chunk_size=chunk_size,
        temperature=temperature,
        with_dynamics=with_dynamics,
    )


def global_mean(total: Tensor, count: Tensor, trainer: Any | None) -> tuple[Tensor, Tensor]:
    """``total / count`` with both summed over all processes: (term to backpropagate, value to log).

    DDP averages gradients over ``world`` ranks, so the backpropagated term is scaled by ``world``: the
    resulting gradient is exactly that of the global mean, whatever each rank's share of the count.
    """
    stats = torch.stack([total.detach().float(), count.detach().float()])
    world = 1
    if trainer is not None and trainer.world_size > 1:
        world = trainer.world_size
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
    denominator = stats[1].clamp(min=1.0)
    return total * world / denominator, stats[0] / denominator


def adamw(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over trainable parameters, decaying matrices only (norm gains and biases are not decayed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def save_backbone(model: PreTrainedModel, tokenizer: Any, directory: str | Path) -> Path:
    """Write model (safetensors) and tokenizer so that ``load_backbone(directory)`` reloads them.

    A model with LoRA layers is saved merged (an ordinary checkpoint, the live model is untouched); when its
    base weights are still the pretrained ones the adapter is also written to ``directory/adapter`` in PEFT's
    layout. When updates were folded into the base weights (ScaLoRA's column rescaling, LoRARestart, a folded
    SFT warm-up) no adapter is written, by design: the adapter alone is then not the trained model; the log
    says so.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = lora_layers(model)
    if layers:
        if not any(bool(layer.base_modified) for layer in layers.values()):
            save_adapter(model, directory / "adapter")
        else:
            rank_zero_info(
                f"no LoRA adapter is written to {directory / 'adapter'}: updates were folded into the base "
                "weights (ScaLoRA's column rescaling, LoRARestart or a folded warm-up), so the adapter alone is "
                f"not the trained model; {directory} holds the merged model"
            )
        model = merge_lora(copy.deepcopy(model))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


#: The file an export of a training run carries: which run wrote the directory (``run_id``) and with what.
EXPORT_MARKER = "lightning_llm_export.json"


def export_owner(directory: str | Path) -> str | None:
    """Who wrote ``directory``: the ``run_id`` of its :data:`EXPORT_MARKER`, ``""`` when it holds files but no
    (readable) marker, ``None`` when it is missing or empty."""
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    try:
        return str(json.loads((directory / EXPORT_MARKER).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def check_export(directory: str | Path, run_id: str, *, overwrite: bool, writer: str = "the export") -> None:
    """Raise :class:`FileExistsError` when ``directory`` holds files another run wrote (another ``run_id`` in its
    marker, or no marker at all), unless ``overwrite``; missing and empty directories, and this run's own
    export, pass."""
    owner = export_owner(directory)
    if overwrite or owner is None or owner == run_id:
        return
    what = f"the export of another run (run id {owner})" if owner else f"files with no {EXPORT_MARKER} marker"
    raise FileExistsError(
        f"{writer}: save_dir={directory} already holds {what}; refusing to overwrite it. Choose another "
        "save_dir, or pass overwrite=True (CLI: --model.init_args.overwrite true) to replace it"
    )


def mark_export(directory: str | Path, run_id: str, writer: str) -> None:
    """Write the :data:`EXPORT_MARKER` of ``directory`` (last, once the export is complete)."""
    record = {"run_id": run_id, "writer": writer, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (Path(directory) / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def apply_lora_config(
    model: torch.nn.Module, lora: LoRAConfig | dict[str, Any] | None
) -> dict[str, Any] | None:
    """Apply ``lora`` (a :class:`LoRAConfig` or its fields) to ``model``; returns the fields for hparams."""
    if lora is None:
        return None
    config = lora if isinstance(lora, LoRAConfig) else LoRAConfig(**lora)
    apply_lora(model, config)
    return dataclasses.asdict(config)


def labels_to_mask(input_ids: Tensor, labels: Tensor) -> Tensor:
    """Target mask from HF-style labels (``-100`` = not trained). Labels must equal the input ids elsewhere."""
    mask = labels != IGNORE_INDEX
    if torch.any(labels[mask] != input_ids[mask]):
        raise ValueError("labels must be the input ids with -100 on ignored positions (unshifted, HF style)")
    return mask
