"""Helpers every module shares to get per-token log-probs from a Hugging Face causal LM without logits.

The fused kernel needs the last hidden states and the LM-head weight separately, so the ``[tokens × vocab]``
logits tensor is never built. That is only exact for heads that are a plain bias-free linear map. Models that
post-process logits (soft-capping, a logit scale, a head bias) take the plain path instead
(:func:`logprob_path`, announced once at construction): the model's own head and post-processing on chunks of
positions, each chunk recomputed in backward, so memory stays at one chunk of logits there too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_llm.kernels import entropy_dynamics_reference, fused_linear_logprobs
from lightning_llm.kernels.fused_linear_logprobs import DEFAULT_CHUNK_BYTES
from lightning_llm.lora import LoRAConfig, apply_lora, lora_layers, merge_lora, save_adapter
from lightning_llm.types import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedModel


#: Config attributes through which a model rescales or caps its logits after the head (Gemma 2, Cohere...).
_LOGIT_POSTPROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier_scale",
    "logits_scaling",
)


def fused_unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the fused log-prob path would not be exact for ``model`` (its logits are not ``hidden @ W.T``), or
    None when it is."""
    name = type(model).__name__
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), Tensor):
        return f"{name} has no linear output embedding"
    if getattr(head, "bias", None) is not None:
        return f"{name}'s LM head has a bias"
    config = model.config
    for attr in _LOGIT_POSTPROCESSING:
        value = getattr(config, attr, None)
        if value not in (None, 1.0, 0.0):
            return f"{name} post-processes its logits ({attr}={value})"
    return None


def check_fused_compatible(model: PreTrainedModel) -> None:
    """Raise if the model's logits are not ``hidden @ lm_head.weight.T`` (for code that applies the head
    weight itself; :func:`target_logprobs` falls back to the plain path instead)."""
    reason = fused_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{reason}; this needs logits that are hidden @ W.T (the fused log-prob path)")


def logprob_path(model: PreTrainedModel, *, announce: bool = False) -> Literal["fused", "plain"]:
    """``"fused"`` when the fused kernel is exact for ``model``, else ``"plain"`` (the model's own head and
    logit post-processing, chunked over positions); with ``announce`` a plain choice is said once on rank zero."""
    reason = fused_unsupported_reason(model)
    if reason is None:
        return "fused"
    if announce:
        rank_zero_info(f"{reason}: its log-probs take the plain path (the model's own logits, chunked)")
    return "plain"


class _Hidden(torch.nn.Module):
    """Stands in for a decoder: returns the given hidden states, so the model's forward applies only its head."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def head_logits(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """The model's own logits ``[N, V]`` for final hidden states ``[N, H]``: its forward with the decoder
    replaced by these states, so the head, its bias and any post-processing (soft-capping, a logit scale) are
    exactly the model's."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    name = next(n for n, child in model.named_children() if child is decoder)
    setattr(model, name, _Hidden(hidden[None]))
    try:
        logits = model(input_ids=None, inputs_embeds=hidden[None], use_cache=False).logits
    finally:
        setattr(model, name, decoder)
    return logits[0]


def _plain_chunk(
    model: PreTrainedModel, hidden: Tensor, targets: Tensor, temperature: float, with_dynamics: bool
) -> tuple[Tensor, ...]:
    z = head_logits(model, hidden).float() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    logprobs = log_p.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    if not with_dynamics:
        return logprobs, entropy
    with torch.no_grad():
        s, n = entropy_dynamics_reference(z)
    return logprobs, entropy, s.gather(1, targets[:, None]).squeeze(1), n


def head_logprobs(
    model: PreTrainedModel,
    hidden: Tensor,
    targets: Tensor,
    *,
    path: Literal["auto", "fused", "plain"] = "auto",
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_dynamics: bool = False,
) -> tuple[Tensor, ...]:
    """Log-prob of ``targets`` ``[N]`` and entropy (with ``with_dynamics`` also S_k and N, see
    :func:`~lightning_llm.kernels.fused_linear_logprobs`) from final hidden states ``[N, H]``, fp32 vectors.

    ``path="fused"`` is the fused kernel over the head weight; ``"plain"`` applies :func:`head_logits`
    ``chunk_size`` positions at a time (default: the fused kernel's chunk budget), each chunk recomputed in
    backward (activation checkpointing), so neither path holds more than one chunk of ``[positions × vocab]``;
    ``"auto"`` is :func:`logprob_path`. The dynamics terms are detached on both paths.
    """
    if path == "auto":
        path = logprob_path(model)
    if path == "fused":
        return fused_linear_logprobs(
            hidden,
            model.get_output_embeddings().weight,
            targets,
            chunk_size=chunk_size,
            temperature=temperature,
            with_dynamics=with_dynamics,
        )
    if path != "plain":
        raise ValueError(f"path must be 'auto', 'fused' or 'plain', got {path!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    vocab = model.get_output_embeddings().weight.shape[0]
    step = chunk_size or max(1, DEFAULT_CHUNK_BYTES // (vocab * hidden.element_size()))
    checkpointed = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in model.parameters())
    )
    parts = []
    for start in range(0, hidden.shape[0], step):
        args = (
            model,
            hidden[start : start + step],
            targets[start : start + step],
            temperature,
            with_dynamics,
        )
        if checkpointed:
            parts.append(checkpoint(_plain_chunk, *args, use_reentrant=False))
        else:
            parts.append(_plain_chunk(*args))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return tuple(empty for _ in range(4 if with_dynamics else 2))
    return tuple(torch.cat(column) for column in zip(*parts, strict=True))


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
    path: Literal["auto", "fused", "plain"] = "auto",
) -> tuple[Tensor, ...]:
    """Log-prob and entropy (with ``with_dynamics`` also S_k and N) of each next token in ``target_mask``.

    ``target_mask[b, t]`` says whether token ``t`` of row ``b`` is predicted (from position ``t − 1``); the
    first column is ignored. Returns flat fp32 vectors in row-major order of the selected tokens: only those
    tokens go through the LM head, so masked prompt tokens cost no vocabulary work. ``path`` picks the fused
    kernel or the model's own logits (:func:`head_logprobs`; ``"auto"``: :func:`logprob_path`).
    """
    hidden = last_hidden_states(model, input_ids, attention_mask)
    select = target_mask[:, 1:].bool()
    return head_logprobs(
        model,
        hidden[:, :-1][select],
        input_ids[:, 1:][select],
        path=path,
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
