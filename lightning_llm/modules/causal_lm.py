"""Supervised fine-tuning / language-model training of any causal LM."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.backbones import apply_chat_template, eval_mode
from lightning_llm.lm import (
    adamw,
    global_mean,
    labels_to_mask,
    target_logprobs,
)
from lightning_llm.lora import LoRAConfig
from lightning_llm.modules.base import BackboneModule
from lightning_llm.text import PromptPrefix, prefix_messages

__all__ = ["CausalLMModule", "warmup_cosine"]


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLMModule(BackboneModule):
    r"""Masked next-token training: :math:`\mathcal{L} = -\frac{1}{|M|}\sum_{t \in M} \log \pi_\theta(y_t \mid y_{<t})`.

    ``M`` is the set of label tokens over the *whole* global batch: under DDP each rank divides its summed
    loss by the all-reduced token count (times the world size, since DDP averages gradients), so two ranks
    with batch ``B`` take exactly the step one process takes with batch ``2B``, whatever the padding.
    Log-probs come from :func:`lightning_llm.kernels.fused_linear_logprobs` (or, for a model that post-processes
    its logits, the plain path of :func:`lightning_llm.lm.head_logprobs`, one chunk at a time), so the
    ``[tokens × vocab]`` logits are never materialised and prompt tokens (label ``-100``) never reach the LM head.

    Args:
        model: ``"tiny"`` (embedded, offline), a Hugging Face id, or a local directory.
        lr: peak AdamW learning rate.
        weight_decay: AdamW decoupled weight decay, applied to matrices only (not norms or biases).
        betas: AdamW betas.
        warmup_ratio: fraction of the total optimisation steps spent warming the LR up linearly.
        min_lr_ratio: the cosine schedule decays to ``lr * min_lr_ratio``.
        gradient_checkpointing: recompute activations in backward (HF's non-reentrant checkpointing).
        logprob_chunk_size: tokens per chunk of the fused log-prob kernel (``None``: chosen by the kernel).
        dtype: parameter dtype of the loaded model (``"bfloat16"``...); ``None`` keeps the checkpoint's.
        trust_remote_code: allow a checkpoint's own Python code. Off by default.
        save_dir: if set, the trained model and tokenizer are written there with ``save_pretrained``
            (safetensors) at the end of ``fit``, not by a ``fast_dev_run``; ``load_backbone(save_dir)`` reloads
            them. With LoRA the model is saved merged, plus the adapter in PEFT's layout under
            ``save_dir/adapter`` while the base weights are untouched. ScaLoRA and LoRARestart fold updates into
            the base weights, so after them no adapter is written, by design (the log says so): the merged model
            is the export. The directory gets a marker with the run id (see :class:`BackboneModule`).
        overwrite: let the export replace a ``save_dir`` that holds files another run wrote (or files with no
            export marker); otherwise such a ``save_dir`` stops the fit at its start.
        lora: train a LoRA adapter (:class:`~lightning_llm.lora.LoRAConfig`) instead of all weights.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int | None = None,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        save_dir: str | None = None,
        overwrite: bool = False,
        lora: LoRAConfig | None = None,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.save_hyperparameters(ignore=["lora"])
        # Stored as plain fields so checkpoints stay loadable with weights_only=True.
        self.hparams["lora"] = dataclasses.asdict(lora) if isinstance(lora, LoRAConfig) else lora
        self._init_tokenizer()

    # ------------------------------------------------------------------------------------------- loss

    def token_logprobs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(log-probs, entropy) of every labelled token of the batch, as flat fp32 vectors."""
        mask = labels_to_mask(batch["input_ids"], batch["labels"])
        return target_logprobs(
            self.model,
            batch["input_ids"],
            batch.get("attention_mask"),
            mask,
            chunk_size=self.hparams.logprob_chunk_size,
        )

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(loss to backpropagate, global token-mean NLL to log)."""
        logprobs, _ = self.token_logprobs(batch)
        count = torch.tensor(float(logprobs.numel()), device=logprobs.device)
        return global_mean(-logprobs.sum(), count, self._trainer)

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, logged = self._loss(batch)
        self.log("train/loss", logged, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _, logged = self._loss(batch)
        # Already all-reduced inside _loss: every rank logs the same value, no sync needed.
        self.log("val/loss", logged, prog_bar=True, batch_size=batch["input_ids"].shape[0])

    @override
    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        _, logged = self._loss(batch)
        self.log("test/loss", logged, batch_size=batch["input_ids"].shape[0])

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, str]]:
        """Greedy completions for a batch of prompts (``PromptDataModule`` batches or SFT batches)."""
        completions = self.generate_ids(batch["input_ids"], batch["attention_mask"])
        prompts = batch.get("prompt") or self.tokenizer.batch_decode(
            batch["input_ids"], skip_special_tokens=True
        )
        return [{"prompt": p, "completion": c} for p, c in zip(prompts, completions, strict=True)]

    # ------------------------------------------------------------------------------------- generation

    def encode_prompts(self, prompts: list[str], *, system_prompt: PromptPrefix = None) -> dict[str, Tensor]:
        """User messages rendered with the chat template and a generation prompt, left-padded, on this device:
        ``{"input_ids", "attention_mask"}`` ready for :meth:`generate_ids`."""
        rendered = []
        for prompt in prompts:
            messages = prefix_messages(system_prompt)
            messages.append({"role": "user", "content": prompt})
            rendered.append(apply_chat_template(self.tokenizer, messages, add_generation_prompt=True))
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"  # generation appends on the right
        try:
            enc = self.tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
        finally:
            self.tokenizer.padding_side = side
        enc = enc.to(self.device)
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
        system_prompt: PromptPrefix = None,
    ) -> list[str]:
        """Complete user messages, rendered with the tokenizer's chat template. ``temperature=0`` is greedy."""
        enc = self.encode_prompts(prompts, system_prompt=system_prompt)
        return self.generate_ids(
            enc["input_ids"],
            enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
        )

    @torch.no_grad()
    def generate_ids(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> list[str]:
        """Complete left-padded token ids; returns the decoded new text (control tokens dropped)."""
        with eval_mode(self.model):
            sampling = temperature > 0
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                do_sample=sampling,
                temperature=temperature if sampling else None,
                top_p=top_p if sampling else None,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_token_ids,
            )
        return self.tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)

    # ------------------------------------------------------------------------------------ optimisation

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = adamw(self.model, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(hp.warmup_ratio * total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, total, warmup, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
